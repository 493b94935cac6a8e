"""The round trip of one control call, the way a weight push reaches an engine replica: a Ray actor call
(the bench's `ActorReplica`), a Serve handle call, and a Serve `broadcast` (the training loop's
`EngineControl.call`, every push's load goes through it), each to a replica that answers at once.

    python benchmarks/control_latency.py [--calls 60] [--warmup 10] [--out row.json]

Prints one JSON row: median and p90 milliseconds of each, after the warm-up calls. On the 2-core CPU
machine (2026-11-27): actor 1.27 ms, Serve call 2.71, Serve broadcast 2.33
(docs/results/control_latency_cpu_2026-11-27.json; docs/BENCHMARKS.md, issue 28).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
from pathlib import Path


class Pinged:
    """A replica that answers at once."""

    async def ping(self, x=None):
        return {"replica_id": "r", "x": x}


async def run(calls: int, warmup: int) -> dict:
    import ray
    from ray import serve

    Replica = serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0.1})(Pinged)
    Actor = ray.remote(num_cpus=0.1)(Pinged)

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start()
        handle = serve.run(Replica.bind(), name="control-latency", route_prefix=None)
        actor = Actor.remote()
        kinds = {"actor_call": lambda: actor.ping.remote(1), "serve_call": lambda: handle.ping.remote(1),
                 "serve_broadcast": lambda: handle.broadcast(Pinged.ping.__name__, 1).results_async(timeout_s=30)}
        row: dict = {"machine": platform.node(), "calls": calls, "warmup": warmup}
        for name, call in kinds.items():
            times = []
            for _ in range(calls + warmup):
                t = time.perf_counter()
                await call()
                times.append(time.perf_counter() - t)
            timed = sorted(times[warmup:])
            row[name] = {"median_ms": round(1e3 * statistics.median(timed), 3),
                         "p90_ms": round(1e3 * timed[int(0.9 * (len(timed) - 1))], 3)}
        return row
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.calls < 1 or args.warmup < 0:
        ap.error("--calls must be >= 1 and --warmup >= 0")
    row = asyncio.run(run(args.calls, args.warmup))
    print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
