"""asyncrl's side of the peer benchmark (issue 32): the same knobs as benchmarks/peers/trl_grpo.py, as asyncrl
config overrides, run by benchmarks/async_speedup.py's `run_once` (one Serve app per eta, in one Ray session),
each run printed as one JSON row of benchmarks/peers/common.py's shape.

Placements on one GPU:
  hybrid     deploy/rlhf-hybrid1.yaml: the engine and the learner take turns on the device (engine asleep while
             the learner trains; the learner's state in host memory while the engine generates; CUDA IPC push)
  separated  deploy/rlhf-gpu1.yaml: the engine (0.4 GPU, 30 % of its memory) and the learner (0.5 GPU) share the
             device at the same time; generation for the next batches overlaps training when eta > 0

The knobs become (every --set after them wins):
  model.path, model.dtype bfloat16, model.max_model_len     --model, bf16, --max-model-len (max-new-tokens + 128)
  buffer.batch_size = prompts x group, algorithm.group_size, algorithm.max_new_tokens, algorithm.ignore_eos
  learner.lr (constant, lr_warmup_steps 0), learner.micro_batch_size (0 = the whole batch, as TRL's)
  data: the arithmetic task (--digits), trainer.seed (--seed): the prompt order trl_grpo.py replays
  weightsync.verify checksum (every byte, summed on the GPU; rlhf-gpu1.yaml's default, full sha256, is not what
             a benchmark against a peer that verifies nothing should pay)
  per eta: trainer.rollout_concurrency = prompts x (eta + 1), engine max_num_seqs = batch x (eta + 1), the
             buffer's capacity and the replica's max_ongoing_requests at least that: the bound eta admits them all
The split of a step, from the learner's metrics (time/*): training = time/train_s (proximal log-probs, the
update; hybrid: the engine's sleep and the learner's onload too), weight_sync = time/sync_s (the push; hybrid: the
engine's wake too), generation = the rest of the step, the learner waiting for its batch: generation (and
rewards) not hidden behind training, so less at eta > 0; idle = 0 (not told apart from that wait).
Completion lengths: each step's `train/response_lengths` (the learner's batch, in the run's metrics.jsonl).
Steps with a held-out evaluation (--eval-every) are left out of s/step (the evaluation runs inside the step).

    python benchmarks/peers/asyncrl_side.py --placement hybrid --etas 0 --model /tmp/qwen2-0.5b-random \\
        --prompts-per-step 8 --group-size 8 --max-new-tokens 256 --lr 1e-6 --warmup-steps 3 --steps 8 --num-cpus 16
    python benchmarks/peers/asyncrl_side.py --placement separated --etas 0 1 2 ...   (the same knobs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
from async_speedup import BUFFER_KEYS, HYBRID_SWITCH_KEYS, _args_from, apply_overrides, model_params  # noqa: E402
from bench_ray import init_ray  # noqa: E402
from common import StepTime, add_knob_arguments, check_knobs, emit, gpu_name, knobs, max_model_len, package_version, summarize  # noqa: E402

CONFIGS = {"hybrid": Path("deploy/rlhf-hybrid1.yaml"), "separated": Path("deploy/rlhf-gpu1.yaml")}
VERSIONS = ("vllm", "megatron-core", "ray", "torch", "transformers")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_knob_arguments(ap)
    ap.add_argument("--placement", choices=sorted(CONFIGS), default="hybrid", help="which one-GPU Serve config")
    ap.add_argument("--config", type=Path, default=None, help="another Serve YAML instead of the placement's")
    ap.add_argument("--etas", type=int, nargs="+", default=[0], help="staleness bounds, one run each (0 = synchronous)")
    ap.add_argument("--num-cpus", type=float, default=16, help="logical CPUs of the local Ray runtime")
    ap.add_argument("--timeout-s", type=float, default=900, help="per run, from app start to its last step")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="a further config override (dotted path, YAML value), applied after the knobs; repeatable")
    ap.add_argument("--tag", default="", help="words added to the row's placement (what the --set overrides change)")
    a = ap.parse_args(argv)
    check_knobs(ap, a)
    if any(e < 0 for e in a.etas):
        ap.error(f"--etas {a.etas}: each must be >= 0")
    return a


def knob_overrides(a: argparse.Namespace, eta: int) -> list[str]:
    """The shared knobs as `--set` strings for the config of one run at staleness `eta`."""
    batch = a.prompts_per_step * a.group_size
    ahead = eta + 1  # batches the bound lets run at once
    return [
        f"model.path={a.model}", "model.dtype=bfloat16", f"model.max_model_len={max_model_len(a)}",
        f"buffer.batch_size={batch}", f"buffer.capacity={max(512, batch * (ahead + 1))}",
        f"algorithm.group_size={a.group_size}", f"algorithm.max_new_tokens={a.max_new_tokens}",
        f"algorithm.ignore_eos={'true' if a.fixed_length else 'false'}", "algorithm.temperature=1.0", "algorithm.top_p=1.0",
        "algorithm.kl_coef=0.0", f"learner.lr={a.lr}", "learner.lr_warmup_steps=0", "learner.lr_decay_style=constant",
        f"learner.micro_batch_size={a.micro_batch_size or batch}",
        "data.kind=arithmetic", f"data.digits={a.digits}", "data.operators=['+']", "data.seed=0", f"trainer.seed={a.seed}",
        f"trainer.rollout_concurrency={a.prompts_per_step * ahead}",
        f"generator.engine_kwargs.max_num_seqs={batch * ahead}",
        f"generator.max_ongoing_requests={max(64, a.prompts_per_step * ahead)}",
        "weightsync.verify=checksum",
    ]


def _git_head() -> str:
    try:
        # --dirty: a device machine's copy of the tree carries commits (and edits) its .git's HEAD does not know
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, check=True,
                              cwd=HERE).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _versions() -> str:
    return ", ".join([f"asyncrl {_git_head()}"] + [f"{n} {package_version(n)}" for n in VERSIONS])


def response_lengths(run_dir: Path) -> dict[int, list[int]]:
    """Each learner step's completion lengths, from the run's metrics.jsonl (none from an asyncrl that
    does not record them)."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {int(r["train/step"]): r["train/response_lengths"] for r in records
            if "train/step" in r and isinstance(r.get("train/response_lengths"), list)}


# the per-step push metrics a row keeps (`weightsync_per_step`)
WEIGHTSYNC_STEP_KEYS = ("weightsync/push_seconds", "weightsync/paused_seconds", "weightsync/host_copy_wait_seconds",
                        "weightsync/host_copy_seconds", "weightsync/on_live_seconds",
                        "weightsync/sender/host_copy_thread_copy_seconds",
                        "weightsync/sender/host_copy_thread_keep_seconds", "weightsync/sender/broadcast_seconds",
                        "weightsync/sender/hash_seconds", "weightsync/sender/receivers_after_seconds")


def row_of(a: argparse.Namespace, eta: int, res: dict[str, Any], placement: str,
           lengths: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """run_once's result as a common row: per-step walls from time/elapsed_s, the split from time/*, the
    completion lengths from `lengths` (learner step -> its batch's, `response_lengths`)."""
    lengths = lengths or {}
    steps, prev = [], None
    for r in res["per_step"]:
        elapsed = r["time/elapsed_s"]
        wall = elapsed - prev if prev is not None else elapsed  # step 1: from the loop's start (warm-up anyway)
        prev = elapsed
        train, sync = r["time/train_s"], r["time/sync_s"]
        n = int(r["train/step"])
        steps.append(StepTime(step=n, wall_s=wall, generation_s=max(wall - train - sync, 0.0), training_s=train,
                              weight_sync_s=sync, completion_tokens=int(r.get("train/response_tokens") or 0),
                              warmup=n <= a.warmup_steps or r.get("eval/accuracy") is not None,
                              completion_lengths=lengths.get(n, [])))
    evals = res.get("eval", [])
    origin = evals[0]["time"] if evals and evals[0]["step"] == 0 else None
    rewards = [r["train/reward_mean"] for r in res["per_step"] if r.get("train/reward_mean") is not None]
    # hybrid: the share of switches at which every learner rank kept its state on the device (learner_offload
    # when_short found room for the engines' wake beside it); None where no switch reported it
    last = res["per_step"][-1] if res["per_step"] else {}
    # engine vs learner log-probs (asyncrl/algorithms/mismatch.py), each metric's mean over the steps that report it
    names = sorted({k for r in res["per_step"] for k in r if k.startswith("mismatch/")})
    mismatch = {k.removeprefix("mismatch/"): statistics.fmean(r[k] for r in res["per_step"] if r.get(k) is not None)
                for k in names if any(r.get(k) is not None for r in res["per_step"])}
    kept = [r["hybrid/learner_state_kept"] for r in res["per_step"] if r.get("hybrid/learner_state_kept") is not None]
    timed = {s.step for s in steps if not s.warmup}  # (the steps split_s is over)
    return {
        "system": "asyncrl", "placement": placement, "eta": eta, "version": _versions(),
        "model": a.model, "params": model_params(a.model), **knobs(a, "bf16"), "warmup_steps": a.warmup_steps,
        **summarize(steps, a.max_new_tokens), "gpu": gpu_name(), "reward_mean": statistics.fmean(rewards) if rewards else None,
        "eval": [{"step": e["step"], "wall_s": e["time"] - origin, "accuracy": e["accuracy"]} for e in evals] if origin else [],
        "start_s": res.get("start_s"), "first_step_s": res.get("first_step_s"),
        # where step 1's time went: its split, push phases (weightsync/sender/*, replica/*) and sizes
        "first_step": next((r for r in res["per_step"] if int(r["train/step"]) == 1), None),
        # every step's push and the last push's host copies (a collective push's are kept beside the next step and
        # reported by the push after it): where a step's time beside the weights went
        "weightsync_per_step": [{"step": int(r["train/step"]), **{k.removeprefix("weightsync/"): r[k] for k in
                                 WEIGHTSYNC_STEP_KEYS if r.get(k) is not None}} for r in res["per_step"]],
        "settings": {"config": str(a.config or CONFIGS[a.placement]), "overrides": knob_overrides(a, eta) + a.overrides,
                     "staleness_mean": res.get("staleness_mean"), "push_s": res.get("push_s"),
                     "push_failed": res.get("push_failed"), "learner_mfu": res.get("learner_mfu"),
                     "learner_peak_gib": res.get("learner_peak_gib"),
                     "learner_state_kept": statistics.fmean(kept) if kept else None,
                     # hybrid: the switches' means over the timed steps, as split_s's (weight_sync_s = push + engine wake)
                     **{f"{k}_mean": statistics.fmean(v) for k in HYBRID_SWITCH_KEYS
                        if (v := [r[f"hybrid/{k}"] for r in res["per_step"]
                                  if int(r["train/step"]) in timed and r.get(f"hybrid/{k}") is not None])},
                     # the buffer's accounting at the last step: a group dropped stale is generation thrown away
                     # (and, on a long tail, the longest responses trained less often)
                     "buffer": {k.removeprefix("buffer/"): last[k] for k in BUFFER_KEYS if k in last},
                     "mismatch": mismatch},
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import ray
    from async_speedup import run_once

    config = a.config or CONFIGS[a.placement]
    placement = a.placement if a.config is None else f"{a.placement} ({config})"
    placement = f"{placement} {a.tag}".strip()
    init_ray(a.num_cpus)
    try:
        with tempfile.TemporaryDirectory(prefix="asyncrl-peers-") as tmp:
            for eta in a.etas:
                base = apply_overrides(_args_from(config), knob_overrides(a, eta) + a.overrides)
                print(f"[asyncrl] {placement} eta={eta}: {a.warmup_steps} + {a.steps} steps of "
                      f"{a.prompts_per_step} x {a.group_size} x {a.max_new_tokens} tokens", flush=True)
                run_dir = Path(tmp) / f"eta{eta}"

                def report(res: dict[str, Any], eta: int = eta, run_dir: Path = run_dir) -> None:
                    # also from inside run_once when the caller's limit (SIGINT) cuts the run short: the row
                    # then covers the steps that finished (`finished` false)
                    row = row_of(a, eta, res, placement, response_lengths(run_dir)) | {"finished": res.get("finished", True)}
                    for s in row["per_step"]:
                        print(f"[asyncrl] step {s['step']}{' (left out)' if s['warmup'] else ''}: {s['wall_s']:.2f} s = "
                              f"generation wait {s['generation_s']:.2f} + training {s['training_s']:.2f} + weight sync "
                              f"{s['weight_sync_s']:.2f}" + ("" if s.get("length_mean") is None else
                                                            f"; completions of {s['length_mean']:.0f} tokens on average"), flush=True)
                    if row["settings"]["buffer"]:
                        print(f"[asyncrl] eta={eta} buffer: " + " ".join(f"{k}={v:g}" for k, v in row["settings"]["buffer"].items()), flush=True)
                    if not row["finished"]:
                        print(f"[asyncrl] eta={eta}: cut short by its limit; the row covers the steps above", flush=True)
                    emit(row, a.out)  # after every run: a call cut short keeps what finished

                run_once(base, eta, a.warmup_steps + a.steps, run_dir, a.timeout_s, eval_interval_steps=a.eval_every,
                         emit=report)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
