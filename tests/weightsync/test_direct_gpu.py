"""The direct apply and its device checksum on a GPU (vLLM 0.24 there; skipped without CUDA).

Checks: the Triton checksum of every tensor of a device bucket equals the numpy one of its host
copy (so a push verified on the GPU and a restore verified from host memory agree); a real vLLM
engine on the GPU proves at start that a copy into its parameters is a correct apply, and after a
push in its layout (bucketed staging: applied bucket by bucket) its greedy tokens are transformers'
argmax on the pushed weights, tied embeddings included, with its parameters at the same addresses
(captured CUDA graphs stay valid)."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np
import pytest
import torch

from .fakes import LocalClient

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_device_checksums_equal_host_checksums_segment_for_segment():
    from asyncrl.weightsync.bucket import iter_buckets
    from asyncrl.weightsync.checksum import segment_checksums
    from asyncrl.weightsync.fingerprint import bucket_digests

    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 255, (3 * (1 << 20) + 7,), dtype=torch.uint8, generator=g)
    segments = [(0, 8), (64, 1000), (2048, 70001), (1 << 20, 2 * (1 << 20) + 7)]
    assert segment_checksums(host.cuda(), segments) == segment_checksums(host.numpy(), segments)
    weights = {"a": torch.randn(513, 7, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g),
               "c": torch.randn(1 << 18, generator=g)}
    (bucket,) = list(iter_buckets(weights.items(), 16.0, device="cuda"))
    assert bucket_digests(bucket, "checksum") == bucket_digests(bucket.to_host(), "checksum")
    assert np.array_equal(bucket.to_host().buffer, bucket.buffer.cpu().numpy())


async def _scenario(model_path: str) -> dict:
    from asyncrl.config import GeneratorConfig, ModelConfig, WeightsyncConfig
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.interfaces import WorkerAPI
    from asyncrl.types import GenerationRequest, SamplingParams
    from asyncrl.weightsync.plan import ManifestEntry, build_plan
    from asyncrl.weightsync.push import Publisher
    from asyncrl.weightsync.registry import VersionRegistry
    from asyncrl.weightsync.replica_side import dump_manifest
    from asyncrl.weightsync.store import load_hf_tensors
    from asyncrl.weightsync.transport import LocalTransport

    replica = EngineReplica(ModelConfig(path=model_path, max_model_len=256),
                            GeneratorConfig(engine_kwargs={"gpu_memory_utilization": 0.3}), replica_id="gpu0")
    await replica.start()
    try:
        base = load_hf_tensors(model_path)
        manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in base.items()]
        (layout,) = [pickle.loads(b) for b in (await replica.engine_layout(dump_manifest(manifest)))["layouts"]]
        plan = build_plan(manifest, [layout], 0.5)
        await replica.set_push_plan(pickle.dumps(plan))

        async def param_addresses() -> list[int]:
            return (await replica._rpc(WorkerAPI.asyncrl_param_addresses))[0]

        before = await param_addresses()
        g = torch.Generator().manual_seed(3)
        new = {n: t + 0.2 * t.float().std().clamp_min(1e-3) * torch.randn(t.shape, generator=g) for n, t in base.items()}
        pub = Publisher(WeightsyncConfig(bucket_mb=0.5, verify="checksum", staging="bucketed", timeout_s=120),
                        transport=LocalTransport(), registry=VersionRegistry(0))
        pub.set_plan(plan)
        result = await pub.publish(1, iter(new.items()), [LocalClient(replica)])
        prompts = [[5, 17, 9, 33, 2], [12, 4, 4, 7]]
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=False)
        outs = [await replica.generate(GenerationRequest(prompt_ids=p, sampling=sp)) for p in prompts]
        return {"check": replica._staging.layout_report[0], "metrics": result.metrics, "new": new, "prompts": prompts,
                "tokens": [o.completions[0].token_ids for o in outs], "versions": [o.completions[0].versions for o in outs],
                "same_addresses": before == await param_addresses()}
    finally:
        replica.shutdown()


def test_a_direct_push_into_a_gpu_engine_decodes_transformers_tokens(demo_model_path):
    from transformers import AutoModelForCausalLM

    out = asyncio.run(_scenario(str(demo_model_path)))
    assert out["check"]["direct"], out["check"]
    assert out["metrics"]["weightsync/apply_direct"] == 1.0 and out["metrics"]["weightsync/staging_bucketed"] == 1.0
    assert out["same_addresses"]  # copied into the live storage: captured CUDA graphs still point at it
    model = AutoModelForCausalLM.from_pretrained(str(demo_model_path), dtype=torch.float32).eval()
    model.load_state_dict(out["new"], strict=False)
    model.tie_weights()
    with torch.no_grad():
        for prompt, tokens, versions in zip(out["prompts"], out["tokens"], out["versions"]):
            assert versions == [1] * len(tokens)
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            assert bool((chosen >= logits.max(dim=1).values - 1e-3).all()), (prompt, tokens)
