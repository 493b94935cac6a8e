"""Wall time for the same number of trained samples, synchronous (eta = 0) vs asynchronous (eta = 2).

Both runs use the same Serve application (`deploy/rlhf.yaml`'s args unless --config names
another Serve YAML), the same hardware and the same number of learner steps, one after the
other in one Ray session. Time is split per run into
  train  learner time (proximal/ref log-probs, advantages, update)      sum of time/train_s
  sync   weight publication to every engine replica                    sum of time/sync_s
  wait   the learner waiting for a full batch (generation not hidden)   wall - train - sync
Eval and checkpoints are off so that only the loop is timed. The first step is excluded
(warm-up: engine and learner caches, first batch of the run).

  python benchmarks/async_speedup.py --steps 40
  python benchmarks/async_speedup.py --config deploy/rlhf-gpu.yaml --steps 40 --etas 0 1 2
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args_from(config: Path) -> dict:
    doc = yaml.safe_load(config.read_text())
    return dict(doc["applications"][0]["args"]) if "applications" in doc else doc


def run_once(base: dict, eta: int, steps: int, run_dir: Path, timeout_s: float) -> dict:
    from ray import serve

    from asyncrl.app import build_app
    from asyncrl.config import load_config

    port = _free_port()
    raw = json.loads(json.dumps(base))
    raw.setdefault("buffer", {})["max_staleness"] = eta
    raw.setdefault("trainer", {}).update(total_steps=steps, eval_interval_steps=0)
    raw.setdefault("checkpoint", {}).update(interval_steps=0, dir=str(run_dir / "ckpt"))
    raw.setdefault("logging", {}).update(dir=str(run_dir), tensorboard=False, plot_interval_steps=0)
    raw.setdefault("generator", {})["http_port"] = port
    raw["generator"]["direct_http_port"] = None  # the loop is measured, not the HTTP path: no fixed port (rlhf.yaml: 8001)
    cfg = load_config(raw, source=f"async_speedup eta={eta}")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(cfg), name=f"speedup-eta{eta}", route_prefix="/", blocking=False)
        deadline = time.monotonic() + timeout_s
        status: dict = {}
        while time.monotonic() < deadline:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/train/status", timeout=30).json()
            except (httpx.TransportError, ValueError):
                status = {}
            if status.get("state") in ("finished", "failed"):
                break
            time.sleep(2)
        if status.get("state") != "finished":
            raise RuntimeError(f"eta={eta}: run did not finish: {status}")
    finally:
        serve.delete(f"speedup-eta{eta}")
        serve.shutdown()
    rows = [r for r in (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/step" in r]
    timed = rows[1:]  # step 1 is warm-up
    wall = timed[-1]["time/elapsed_s"] - rows[0]["time/elapsed_s"]
    train = sum(r["time/train_s"] for r in timed)
    sync = sum(r["time/sync_s"] for r in timed)
    samples = sum(1 for _ in timed) * cfg.buffer.batch_size
    return {
        "eta": eta, "steps_timed": len(timed), "samples": samples, "wall_s": wall, "train_s": train, "sync_s": sync,
        "wait_s": max(wall - train - sync, 0.0), "samples_per_s": samples / wall,
        "staleness_mean": sum(r.get("buffer/staleness_mean", 0.0) for r in timed) / len(timed),
        "reward_mean": sum(r["train/reward_mean"] for r in timed) / len(timed),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("deploy/rlhf.yaml"), help="Serve YAML (or a bare RootConfig YAML)")
    ap.add_argument("--steps", type=int, default=40, help="learner steps per run (the first is warm-up)")
    ap.add_argument("--etas", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--num-cpus", type=float, default=4, help="logical CPUs for the local Ray runtime")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.steps < 3:
        ap.error(f"--steps={a.steps}: need at least 3 (one warm-up step is excluded)")
    import ray

    base = _args_from(a.config)
    ray.init(num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False)
    results = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-speedup-") as tmp:
        for eta in a.etas:
            res = run_once(base, eta, a.steps, Path(tmp) / f"eta{eta}", a.timeout_s)
            results.append(res)
            print(json.dumps(res), flush=True)
    ray.shutdown()
    ref = results[0]
    print(f"\nmachine: {platform.node()} {platform.machine()}, config {a.config}, {a.steps} steps per run")
    print("| eta | wall s | train s | sync s | wait s | samples/s | staleness | speedup vs eta=%d |" % ref["eta"])
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['eta']} | {r['wall_s']:.1f} | {r['train_s']:.1f} | {r['sync_s']:.1f} | {r['wait_s']:.1f} | "
              f"{r['samples_per_s']:.1f} | {r['staleness_mean']:.2f} | {ref['wall_s'] / r['wall_s']:.2f}x |")
    if a.out:
        a.out.write_text(json.dumps({"config": str(a.config), "steps": a.steps, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
