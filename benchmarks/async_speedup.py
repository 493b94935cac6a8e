"""Wall time for the same number of trained samples, synchronous (eta = 0) vs asynchronous (eta = 2).

Both runs use the same Serve application (`deploy/rlhf.yaml`'s args unless --config names
another Serve YAML), the same hardware and the same number of learner steps, one after the
other in one Ray session. Time is split per run into
  train  learner time (proximal/ref log-probs, advantages, update)      sum of time/train_s
  sync   weight publication to every engine replica                    sum of time/sync_s
  wait   the learner waiting for a full batch (generation not hidden)   wall - train - sync
Eval and checkpoints are off so that only the loop is timed. The first step is excluded
(warm-up: engine and learner caches, first batch of the run; --warmup-steps excludes more). At eta > 0 the engine runs ahead during
that step, so a short run trains batches generated before its timed window and can beat the engine's
pace (even the 2x overlap bound): each run also reports the share trained from before the window and
the steady-state s/step, max(the window's, response tokens per step / the engine's tokens/s), and the
speedup by it (`steady_state`). Per run also: the push (seconds,
GB/s, how long engines were paused), rollout tokens/s, and the learner's MFU:
  8 x params x train/tokens / time/train_s / (learner GPUs x --peak-flops)
(8 = the update's forward and backward (6) plus the proximal log-prob forward (2); attention's
sequence-quadratic FLOPs are not counted; params from the model's config.json, tied embedding once).
--set KEY=VALUE overrides a field of the config (dotted, YAML value), e.g. the model path.

  python benchmarks/async_speedup.py --steps 40
  python benchmarks/async_speedup.py --config deploy/rlhf-gpu.yaml --steps 40 --etas 0 1 2
  python benchmarks/async_speedup.py --config deploy/rlhf-gpu4.yaml --steps 8 --etas 0 2 --set model.path=/tmp/qwen2-7b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml
from bench_ray import init_ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args_from(config: Path) -> dict:
    doc = yaml.safe_load(config.read_text())
    return dict(doc["applications"][0]["args"]) if "applications" in doc else doc


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`a.b.c=VALUE` (VALUE parsed as YAML) into the nested config dict."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        node = raw
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise SystemExit(f"--set {item!r}: {part} is not a section")
        node[leaf] = yaml.safe_load(value)
    return raw


def model_params(path: str) -> int:
    """Parameters of a decoder-only HF checkpoint (tied embedding once), for MFU: the count that
    `hybrid.enabled: auto` sizes the learner by (asyncrl/trainer/placement_choice.py)."""
    from transformers import AutoConfig

    from asyncrl.trainer.placement_choice import model_params as count

    return count(AutoConfig.from_pretrained(path))


# hybrid: the switches' seconds (trainer/placement.py): engine_wake_s, the sync's part beside the push, is the sum of
# the last four; engine_sleep_s and learner_onload_s, the training's part beside the update
HYBRID_SWITCH_KEYS = ("engine_wake_s", "engine_sleep_s", "learner_onload_s", "learner_release_s", "weights_wake_s",
                      "params_release_s", "kv_wake_s", "learner_released_gib")
# The buffer's accounting kept in each per-step row: a group dropped stale is generation thrown away.
BUFFER_KEYS = ("buffer/generated", "buffer/trained", "buffer/dropped_stale", "buffer/dropped_failed", "buffer/overdue")


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def run_once(base: dict, eta: int, steps: int, run_dir: Path, timeout_s: float, peak_flops: float = 989e12,
             eval_interval_steps: int = 0, warmup: int = 1, emit: Callable[[dict], None] | None = None) -> dict:
    """One Serve app at staleness `eta` for `steps` learner steps; its figures over the steps after the first
    `warmup`, every step's row (`per_step`) and the held-out evaluations (`eval`: step, unix time, accuracy;
    none unless `eval_interval_steps`). `timeout_s` counts from this call (the app's start is in it). A run that
    reaches it, or is interrupted (SIGINT: a caller's `timeout -s INT`), with at least 2 steps after the warm-up
    is reported over the steps it finished (`finished` false). `emit` gets the figures before the app is torn
    down (a teardown cut short by the caller's own limit keeps them)."""
    deadline = time.monotonic() + timeout_s
    if not 1 <= warmup < steps:
        raise ValueError(f"warmup={warmup}: between 1 and steps - 1 = {steps - 1} (a step at least is timed)")
    from ray import serve

    from asyncrl.app import build_app
    from asyncrl.config import load_config

    port = _free_port()
    raw = json.loads(json.dumps(base))
    raw.setdefault("buffer", {})["max_staleness"] = eta
    raw.setdefault("trainer", {}).update(total_steps=steps, eval_interval_steps=eval_interval_steps)
    raw.setdefault("checkpoint", {}).update(interval_steps=0, dir=str(run_dir / "ckpt"))
    raw.setdefault("logging", {}).update(dir=str(run_dir), tensorboard=False, plot_interval_steps=0)
    raw.setdefault("generator", {})["http_port"] = port
    raw["generator"]["direct_http_port"] = None  # the loop is measured, not the HTTP path: no fixed port (rlhf.yaml: 8001)
    cfg = load_config(raw, source=f"async_speedup eta={eta}")
    # A Serve instance left in the cluster by an earlier run that was killed keeps its HTTP options (Serve
    # ignores ours), and this benchmark would then poll a port nobody serves until its timeout: stop it first.
    serve.shutdown()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        status: dict = {}
        replicas: list[dict] = []  # every poll: the engine replicas and the version each serves
        interrupted: KeyboardInterrupt | None = None
        try:
            launched = time.time()
            serve.run(build_app(cfg), name=f"speedup-eta{eta}", route_prefix="/", blocking=False)
            control = None
            while time.monotonic() < deadline:
                try:
                    status = httpx.get(f"http://127.0.0.1:{port}/train/status", timeout=30).json()
                except (httpx.TransportError, ValueError):
                    status = {}
                control, seen = _replica_versions(control, f"speedup-eta{eta}")
                if seen is not None:
                    replicas.append({"t": time.time(), "policy_version": status.get("policy_version"), "replicas": seen})
                if status.get("state") in ("finished", "failed"):
                    break
                time.sleep(2)
        except KeyboardInterrupt as stop:  # the caller's limit: report what finished, then stop
            interrupted = stop
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        rows = [r for r in records if "train/step" in r]
        try:
            finished = reportable(eta, status, len(rows), steps, warmup, timeout_s)
        except RuntimeError:
            if interrupted is not None:
                raise interrupted from None
            raise
        res = _figures(cfg, eta, records, rows, warmup, peak_flops, replicas)
        res["finished"] = finished
        res |= start_figures(launched, rows)
        if emit is not None:
            emit(res)
        if interrupted is not None:
            raise interrupted
    finally:
        serve.delete(f"speedup-eta{eta}")
        serve.shutdown()
    return res


def start_figures(launched: float, rows: list[dict]) -> dict[str, float | None]:
    """`start_s`: from the app's launch (unix time `launched`, before serve.run) to its training's start (the
    rollouts' start, after step 0's evaluation: step 1's record time less its time/elapsed_s); `first_step_s`:
    step 1's own seconds. None without a step 1."""
    first = next((r for r in rows if r.get("train/step") == 1 and r.get("time") is not None), None)
    if first is None or first.get("time/elapsed_s") is None:
        return {"start_s": None, "first_step_s": None}
    return {"start_s": first["time"] - first["time/elapsed_s"] - launched, "first_step_s": first["time/elapsed_s"]}


def reportable(eta: int, status: dict, done: int, steps: int, warmup: int, timeout_s: float) -> bool:
    """Whether a run whose app reported `status` after `done` learner steps finished (True), or stopped
    at its limit with at least 2 steps after the warm-up to report (False); otherwise RuntimeError."""
    if status.get("state") == "finished":
        return True
    if status.get("state") == "failed" or done < warmup + 2:
        raise RuntimeError(f"eta={eta}: run did not finish ({done} of {steps} steps by its {timeout_s:.0f} s limit): {status}")
    return False


def _figures(cfg: Any, eta: int, records: list[dict], rows: list[dict], warmup: int, peak_flops: float,
             replicas: list[dict]) -> dict:
    """`run_once`'s figures from the run's metrics records (`rows`: the learner steps)."""
    timed = rows[warmup:]  # the first `warmup` steps are left out
    wall = timed[-1]["time/elapsed_s"] - rows[warmup - 1]["time/elapsed_s"]
    train = sum(r["time/train_s"] for r in timed)
    sync = sum(r["time/sync_s"] for r in timed)
    samples = sum(1 for _ in timed) * cfg.buffer.batch_size
    learner_gpus = cfg.learner.world_size * cfg.learner.num_gpus_per_rank
    tokens = sum(r.get("train/tokens", 0.0) for r in timed)
    mfu = (8 * model_params(cfg.model.path) * tokens / train / (learner_gpus * peak_flops)
           if learner_gpus >= 1 and train > 0 else None)
    gen_tokens = rows[-1]["rollout/tokens"] - rows[warmup - 1]["rollout/tokens"]
    return {**steady_state(wall, len(timed), sum(r.get("train/response_tokens", 0.0) for r in timed), gen_tokens),
        "eta": eta, "steps_timed": len(timed), "samples": samples, "wall_s": wall, "train_s": train, "sync_s": sync,
        "wait_s": max(wall - train - sync, 0.0), "samples_per_s": samples / wall,
        "staleness_mean": sum(r.get("buffer/staleness_mean", 0.0) for r in timed) / len(timed),
        "reward_mean": sum(r["train/reward_mean"] for r in timed) / len(timed),
        "train_tokens_per_step": tokens / len(timed), "learner_mfu": mfu,
        # the most a learner rank held on its GPU in an update (None on the CPU)
        "learner_peak_gib": max((r["actor/device_peak_gib"] for r in rows if r.get("actor/device_peak_gib") is not None),
                                default=None),
        "rollout_tokens_per_s": gen_tokens / wall,
        "push_s": _mean(timed, "weightsync/push_seconds"), "push_gbps": _mean(timed, "weightsync/gbps"),
        "push_paused_s": _mean(timed, "weightsync/paused_seconds"), "push_gb": (_mean(timed, "weightsync/bytes") or 0) / 1e9,
        "push_failed": sum(r.get("weightsync/failed", 0.0) for r in rows),
        # the part of push_s spent waiting for the previous version's tail (its host copies, the store's update)
        "push_tail_wait_s": _mean(timed, "weightsync/host_copy_wait_seconds"),
        "per_step": [{**{k: r.get(k) for k in ("train/step", "time/train_s", "time/sync_s", "time/elapsed_s", "train/tokens",
                                                "train/response_tokens", "train/reward_mean", "eval/accuracy",
                                                "weightsync/push_seconds", "weightsync/paused_seconds", "weightsync/engine_replicas",
                                                "weightsync/failed", "buffer/staleness_mean", "weightsync/bytes",
                                                "weightsync/host_copy_wait_seconds", "weightsync/host_copy_seconds",
                                                "weightsync/on_live_seconds", *BUFFER_KEYS,
                                                # hybrid: whether the learner's state stayed, the switches' parts
                                                "hybrid/learner_state_kept", *(f"hybrid/{k}" for k in HYBRID_SWITCH_KEYS))},
                      # where each push's time went: the senders' pack / broadcast / hash / ring waits, each replica's calls
                      **{k: v for k, v in r.items() if k.startswith(("weightsync/sender/", "weightsync/replica/", "mismatch/"))}}
                     for r in rows],
        "eval": [{"step": r.get("step"), "time": r.get("time"), "accuracy": r["eval/accuracy"]}
                 for r in records if isinstance(r.get("eval/accuracy"), (int, float))],
        "replicas_max": max((len(p["replicas"]) for p in replicas), default=None),
        "joins": replica_joins(replicas),
        "replica_timeline": replicas,
    }


def steady_state(wall_s: float, steps: int, trained_response_tokens: float, generated_tokens: float) -> dict[str, float | None]:
    """What a short run's wall time hides at eta > 0: batches generated before the timed window (the
    engine runs ahead by up to eta versions during the warm-up step) are drawn from the buffer, so the
    window can train more than the engine generated in it, and its s/step can beat the engine's pace.
    In a long run the learner cannot outpace the engine: steady s/step = max(the window's s/step,
    response tokens per step / the engine's tokens/s in the window). `drawn_from_buffer`: the share of
    the window's trained response tokens generated before it (0 when the engine kept up)."""
    if steps <= 0 or wall_s <= 0:
        return {"drawn_from_buffer": None, "engine_s_per_step": None, "steady_s_per_step": None}
    per_step = trained_response_tokens / steps
    rate = generated_tokens / wall_s
    engine = per_step / rate if rate > 0 else None
    drawn = max(0.0, 1.0 - generated_tokens / trained_response_tokens) if trained_response_tokens > 0 else 0.0
    return {"drawn_from_buffer": drawn, "engine_s_per_step": engine,
            "steady_s_per_step": max(wall_s / steps, engine) if engine is not None else wall_s / steps}


def balanced_batch(train_s: float, gen_s: float, batch0: int, *, target: float = 0.95, gen_exp: float = 0.75,
                   train_exp: float = 1.1, lo: int = 32, hi: int = 1024, multiple: int = 32) -> int:
    """The batch at which one step's generation should take `target` x its training, from one eta = 0 run at
    `batch0` samples (its per-step training and generation seconds), if generation grows as the batch's
    `gen_exp` power and training as its `train_exp` power. Defaults from the runs of 2026-11-26/27 (two H200s,
    four H100s, docs/BENCHMARKS.md): the decode is bound by the engine's per-step host work, which grows with
    the sequences in flight (~0.75th power), while training grows about linearly. Rounded to `multiple` and
    held to [lo, hi]."""
    if train_s <= 0 or gen_s <= 0 or batch0 <= 0 or gen_exp == train_exp:
        raise ValueError(f"balanced_batch: train_s={train_s}, gen_s={gen_s}, batch0={batch0}, exponents "
                         f"{gen_exp}/{train_exp}: need positive times and batch, and different exponents")
    b = batch0 * (target / (gen_s / train_s)) ** (1.0 / (gen_exp - train_exp))
    return int(max(lo, min(hi, round(b / multiple) * multiple)))


def _balanced_batch_cli(calib: Path, batch0: int) -> int:
    """`--balanced-batch CALIB_JSON BATCH0`: print the balanced batch from a calibration run's JSON
    (`--out` of an eta = 0 run at BATCH0 samples); BATCH0 itself, with the reason on stderr, when the
    file is missing or holds no finished run."""
    try:
        r = json.loads(calib.read_text())["results"][0]
        n = r["steps_timed"]
        train, gen = r["train_s"] / n, r["wait_s"] / n
        b = balanced_batch(train, gen, batch0)
        print(f"calibration at {batch0}: train {train:.2f} s, generation {gen:.2f} s per step -> batch {b}", file=sys.stderr)
    except (OSError, ValueError, KeyError, IndexError, ZeroDivisionError) as e:
        b = batch0
        print(f"calibration failed ({e!r}): batch {batch0}", file=sys.stderr)
    print(b)
    return 0


def _replica_versions(control: Any, app: str) -> tuple[Any, dict[str, int] | None]:
    """({replica: version}, or None while the engines do not answer) and the control handle to reuse."""
    from asyncrl.generator.control import EngineControl

    try:
        control = control or EngineControl(app_name=app)
        return control, asyncio.run(asyncio.wait_for(control.versions(), 20))
    except Exception:  # the app is starting or going away; an autoscaled replica may be mid-start
        return None, None


def replica_joins(timeline: list[dict]) -> list[dict]:
    """Each engine replica that appeared after the first poll that saw any: when, the version it
    first served, and the policy version then (equal, or one behind while a push is in flight,
    when it joined at the live version)."""
    joins: list[dict] = []
    known: set[str] | None = None
    for poll in timeline:
        names = set(poll["replicas"])
        if known is None:
            known = names
            continue
        for name in sorted(names - known):
            joins.append({"replica": name, "t": poll["t"], "first_version": poll["replicas"][name],
                          "policy_version": poll["policy_version"],
                          "others": {k: v for k, v in poll["replicas"].items() if k != name}})
        known |= names
    return joins


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("deploy/rlhf.yaml"), help="Serve YAML (or a bare RootConfig YAML)")
    ap.add_argument("--steps", type=int, default=40, help="learner steps per run (the first --warmup-steps are left out)")
    ap.add_argument("--warmup-steps", type=int, default=1,
                    help="steps left out of each run's figures (>= 1; more lets the batches an eta > 0 engine made "
                         "during the first step drain, so the window shows the steady state)")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--num-cpus", type=float, default=4, help="logical CPUs for the local Ray runtime")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field (dotted path, YAML value); repeatable")
    ap.add_argument("--eval-every", type=int, default=0, metavar="N",
                    help="held-out greedy accuracy every N learner steps (the trainer's eval_interval_steps; 0: none "
                         "but step 0's), in each run's `eval`")
    ap.add_argument("--peak-flops", type=float, default=989e12, help="per learner GPU, for MFU (H100/H200 dense bf16)")
    ap.add_argument("--balanced-batch", nargs=2, metavar=("CALIB_JSON", "BATCH0"), default=None,
                    help="only print the batch at which generation ~ 0.95 x training, from an eta = 0 run's --out "
                         "at BATCH0 samples (balanced_batch), and exit")
    a = ap.parse_args(argv)
    if a.balanced_batch is not None:
        try:
            b0 = int(a.balanced_batch[1])
        except ValueError:
            b0 = 0
        if b0 < 1:
            ap.error(f"--balanced-batch: BATCH0 must be a positive integer, not {a.balanced_batch[1]!r}")
        return _balanced_batch_cli(Path(a.balanced_batch[0]), b0)
    if a.eval_every < 0:
        ap.error(f"--eval-every={a.eval_every}: a number of steps >= 0 (0: no evaluation after step 0)")
    if a.warmup_steps < 1 or a.steps < a.warmup_steps + 2:
        ap.error(f"--steps={a.steps} --warmup-steps={a.warmup_steps}: need warm-up >= 1 and at least 2 timed steps after it")
    import ray

    base = apply_overrides(_args_from(a.config), a.overrides)
    init_ray(a.num_cpus)
    results = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-speedup-") as tmp:
        def emit(res: dict) -> None:  # before each app's teardown: a call cut short keeps what finished
            results.append(res)
            print(json.dumps(res), flush=True)
            if a.out:
                a.out.write_text(json.dumps({"config": str(a.config), "overrides": a.overrides, "steps": a.steps,
                                             "warmup_steps": a.warmup_steps,
                                             "results": results}, indent=1))

        for eta in a.etas:
            run_once(base, eta, a.steps, Path(tmp) / f"eta{eta}", a.timeout_s, a.peak_flops, warmup=a.warmup_steps,
                     emit=emit, eval_interval_steps=a.eval_every)
    ray.shutdown()
    ref = results[0]
    print(f"\nmachine: {platform.node()} {platform.machine()}, config {a.config}, {a.steps} steps per run, "
          f"the first {a.warmup_steps} left out")
    print("| eta | wall s | train s | sync s | wait s | samples/s | staleness | push s | push GB/s | paused s | learner MFU "
          "| speedup vs eta=%d | trained from before the window | steady s/step | steady speedup |" % ref["eta"])
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in results:
        print(f"| {r['eta']} | {r['wall_s']:.1f} | {r['train_s']:.1f} | {r['sync_s']:.1f} | {r['wait_s']:.1f} | "
              f"{r['samples_per_s']:.1f} | {r['staleness_mean']:.2f} | {f(r['push_s'], '.3f')} | {f(r['push_gbps'], '.1f')} | "
              f"{f(r['push_paused_s'], '.3f')} | {f(r['learner_mfu'], '.1%')} | {ref['wall_s'] / r['wall_s']:.2f}x | "
              f"{f(r['drawn_from_buffer'], '.0%')} | {f(r['steady_s_per_step'], '.2f')} | "
              f"{ref['steady_s_per_step'] / r['steady_s_per_step']:.2f}x |")
    for r in results:
        for j in r["joins"]:
            print(f"eta={r['eta']}: engine replica {j['replica']} joined serving version {j['first_version']} "
                  f"(policy version {j['policy_version']}; the others at {sorted(set(j['others'].values()))})")
        if r["push_failed"]:
            print(f"eta={r['eta']}: {r['push_failed']:.0f} failed pushes")
        if r.get("eval"):
            print(f"eta={r['eta']}: held-out accuracy " + ", ".join(f"{e['accuracy']:.3f} (step {e['step']})"
                                                                  for e in r["eval"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
