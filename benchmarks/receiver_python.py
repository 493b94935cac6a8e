"""The engine worker's per-push Python on the receiving side of a whole-version ipc push, without a
device: `WorkerReceiver` stages the same 17 buckets (290 tensors, the 0.5B model's count) push after
push, as the ipc receiver's record cache hands them over, reads their digests and applies them.
Tiny CPU tensors, so the copies cost nothing and what is timed is the Python around them.

    python benchmarks/receiver_python.py [--pushes 200] [--verify off]

Prints one JSON row: milliseconds per push (median of 5 rounds)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asyncrl.weightsync.bucket import Bucket, TensorMeta
from asyncrl.weightsync.worker_verbs import WorkerReceiver


class _Hooks:
    rank = 0
    device = torch.device("cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--tensors", type=int, default=290)
    ap.add_argument("--per-bucket", type=int, default=18)
    ap.add_argument("--verify", default="off", help="verify mode of the staged digests (off: names/dtypes/shapes only)")
    args = ap.parse_args()
    names = [f"model.layers.{i // 12}.p{i}.weight" for i in range(args.tensors)]
    live = {n: torch.nn.Parameter(torch.zeros(8, 8), requires_grad=False) for n in names}
    buckets = []
    for b in range(0, len(names), args.per_bucket):
        metas = [TensorMeta(n, "float32", (8, 8), 256 * j, 256) for j, n in enumerate(names[b:b + args.per_bucket])]
        buckets.append(Bucket(buffer=torch.ones(256 * len(metas), dtype=torch.uint8), metas=metas, rank=0))
    rx = WorkerReceiver(_Hooks())
    rx.plan_id, rx._live = "bench", live  # (set_plan checks a real engine's layout)

    def push(version: int) -> None:
        rx.begin(version, args.verify, "engine")
        for bucket in buckets:
            rx.stage(version, bucket, batch=True)
        rx.digests(version)
        rx.apply(version)

    version = 0
    rounds = []
    for _ in range(6):  # the first round warms up
        t = time.perf_counter()
        for _ in range(args.pushes):
            version += 1
            push(version)
        rounds.append((time.perf_counter() - t) / args.pushes)
    print(json.dumps({"bench": "receiver_python", "tensors": args.tensors, "buckets": len(buckets), "verify": args.verify,
                      "ms_per_push": round(statistics.median(rounds[1:]) * 1e3, 3),
                      "ms_per_push_rounds": [round(r * 1e3, 3) for r in rounds[1:]]}))


if __name__ == "__main__":
    main()
