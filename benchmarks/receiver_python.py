"""The engine worker's per-push Python on the receiving side of a whole-version ipc push, without a device: a vLLM
worker's verbs (`asyncrl_receive`, `asyncrl_apply`) take the same buckets push after push, their tables through a
msgpack round trip as vLLM's RPC sends them, views of one host arena standing in for the sender's mapped ring, and
vLLM's own parameter class as the live parameters (its `__torch_function__` is on the apply's path).
Tiny CPU tensors, so the copies cost nothing and what is timed is the Python around them.

    python benchmarks/receiver_python.py [--pushes 200] [--tensors 254] [--per-bucket 4] [--verify off]

Prints one JSON row: milliseconds per push (median of 5 rounds)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from unittest import mock

import msgspec
import torch

from asyncrl.weightsync import worker_verbs
from asyncrl.weightsync.bucket import Bucket, TensorMeta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pushes", type=int, default=200)
    ap.add_argument("--tensors", type=int, default=254, help="engine tensors (a 3B Qwen2.5 at TP=1: 254)")
    ap.add_argument("--per-bucket", type=int, default=4, help="tensors per bucket (the 3B's 64 MiB buckets: ~3.4)")
    ap.add_argument("--verify", default="off", help="verify mode of the staged digests (off: names/dtypes/shapes only)")
    args = ap.parse_args()
    from vllm.model_executor.parameter import BasevLLMParameter  # (its __init__ wants a TP group; its class suffices)

    names = [f"model.layers.{i // 7}.p{i}.weight" for i in range(args.tensors)]
    model = torch.nn.Module()
    for i, n in enumerate(names):
        model.register_parameter(f"p{i}", BasevLLMParameter.__new__(BasevLLMParameter, torch.zeros(8, 8)))
    live_names = [n for n, _ in model.named_parameters()]
    arena = torch.ones(256 * len(names), dtype=torch.uint8)
    wires, at = [], 0
    for b in range(0, len(names), args.per_bucket):
        metas = [TensorMeta(live_names[i], "float32", (8, 8), 256 * j, 256)
                 for j, i in enumerate(range(b, min(b + args.per_bucket, len(names))))]
        wires.append((f"handle-{b}".encode() + bytes(200), metas, 0, at))
        at += 256 * len(metas)
    at_of = {w[0]: w[3] for w in wires}
    wires = msgspec.msgpack.decode(msgspec.msgpack.encode([w[:3] for w in wires]))  # (as vLLM's RPC hands them over)

    def ipc_open(handle: bytes, metas: list, rank: int | None = None) -> Bucket:  # the sender's ring, mapped
        return Bucket(buffer=arena[at_of[handle] : at_of[handle] + 256 * len(metas)], metas=metas, rank=rank)

    class Hooks:
        rank, device = 0, torch.device("cpu")

        def model(self) -> torch.nn.Module:
            return model

    class Worker(worker_verbs.WorkerVerbs):
        rank = 0

        def _asyncrl_hooks(self) -> Hooks:
            return Hooks()

    worker = Worker()
    begin = [args.verify, "engine", "bench"]
    version = 0
    rounds = []
    with mock.patch.object(worker_verbs, "ipc_open", ipc_open):
        for _ in range(6):  # the first round warms up
            t = time.perf_counter()
            for _ in range(args.pushes):
                version += 1
                worker.asyncrl_receive(version, msgspec.msgpack.decode(msgspec.msgpack.encode(wires)), None, 0.0, "", begin)
                worker.asyncrl_apply(version)
            rounds.append((time.perf_counter() - t) / args.pushes)
    print(json.dumps({"bench": "receiver_python", "tensors": args.tensors, "buckets": len(wires), "verify": args.verify,
                      "ms_per_push": round(statistics.median(rounds[1:]) * 1e3, 3),
                      "ms_per_push_rounds": [round(r * 1e3, 3) for r in rounds[1:]]}))


if __name__ == "__main__":
    main()
