"""The direct apply and its device checksum on a GPU (vLLM 0.24 there; skipped without CUDA).

Checks: the Triton checksum of every tensor of a device bucket equals the numpy one of its host
copy (so a push verified on the GPU and a restore verified from host memory agree); a real vLLM
engine on the GPU proves at start that a copy into its parameters is a correct apply, and after a
push in its layout (staged, then copied in at the commit) its greedy tokens are transformers'
argmax on the pushed weights, tied embeddings included, with its parameters at the same addresses
(captured CUDA graphs stay valid). With two GPUs: an NCCL push from a sender on cuda:1, staged then
applied at the commit, the same tokens; a corrupted bucket refused by the commit's check, nothing applied
(`_nccl_scenario(..., backend="gloo")` runs the same scenario on a CPU, by hand: 2026-11-27, it
passed there). On one GPU: the same scenario from a gloo sender on the host into the GPU worker, and over ipc
from a sender in this process on the engine's GPU."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from .fakes import LocalClient, param_addresses, source_of, streamed

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_device_checksums_equal_host_checksums_segment_for_segment():
    from asyncrl.weightsync.bucket import Bucket, iter_buckets
    from asyncrl.weightsync.fingerprint import bucket_digests, segment_checksums

    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 255, (3 * (1 << 20) + 7,), dtype=torch.uint8, generator=g)
    segments = [(0, 8), (64, 1000), (2048, 70001), (1 << 20, 2 * (1 << 20) + 7)]
    assert segment_checksums(host.cuda(), segments) == segment_checksums(host.numpy(), segments)
    weights = {"a": torch.randn(513, 7, generator=g).to(torch.bfloat16), "b": torch.randn(3, generator=g),
               "c": torch.randn(1 << 18, generator=g)}
    (bucket,) = list(iter_buckets(weights.items(), 16.0, device="cuda"))
    on_host = Bucket(buffer=bucket.buffer.cpu().numpy(), metas=list(bucket.metas))
    assert bucket_digests(bucket, "checksum") == bucket_digests(on_host, "checksum")


async def _plan_for(replica, model_path: str) -> tuple[dict, object]:
    """The checkpoint's tensors, and the push plan `replica` forms in its own layout and holds."""
    from asyncrl.demo_model import load_hf_tensors

    from .fakes import plan_request

    base = load_hf_tensors(model_path)
    ack = await replica.set_push_plan(plan_request(base, 0.5))
    assert ack.plan is not None, ack.problem
    return base, pickle.loads(ack.plan)


def _perturbed(base: dict, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.2 * t.float().std().clamp_min(1e-3) * torch.randn(t.shape, generator=g) for n, t in base.items()}


def _assert_transformers_argmax(model_path: str, weights: dict, prompts: list, served: list) -> None:
    """Each served (tokens, versions) is version 1 and transformers' greedy choice on `weights`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    with torch.no_grad():
        for prompt, (tokens, versions) in zip(prompts, served):
            assert versions == [1] * len(tokens)
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            assert bool((chosen >= logits.max(dim=1).values - 1e-3).all()), (prompt, tokens)


async def _scenario(model_path: str) -> dict:
    from asyncrl.config import GeneratorConfig, ModelConfig, WeightsyncConfig
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.types import GenerationRequest, SamplingParams
    from asyncrl.weightsync.push import Pusher, VersionRegistry
    from tests.weightsync.fakes import LocalChannel

    replica = EngineReplica(ModelConfig(path=model_path, max_model_len=256),
                            GeneratorConfig(engine_kwargs={"gpu_memory_utilization": 0.3}), replica_id="gpu0")
    await replica.start()
    try:
        base, plan = await _plan_for(replica, model_path)

        before = await param_addresses(replica)
        new = _perturbed(base)
        pub = Pusher(WeightsyncConfig(bucket_mb=0.5, verify="checksum", timeout_s=120),
                        transport=LocalChannel(), registry=VersionRegistry(0))
        result = await pub.push(1, source_of(pub, new, plan), [LocalClient(replica)])
        prompts = [[5, 17, 9, 33, 2], [12, 4, 4, 7]]
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=False)
        outs = [await replica.generate(GenerationRequest(prompt_ids=p, sampling=sp)) for p in prompts]
        return {"check": replica.weights.layout_checks[0], "metrics": result.metrics, "new": new, "prompts": prompts,
                "tokens": [o.completions[0].token_ids for o in outs], "versions": [o.completions[0].versions for o in outs],
                "same_addresses": before == await param_addresses(replica)}
    finally:
        replica.shutdown()


def test_a_direct_push_into_a_gpu_engine_decodes_transformers_tokens(demo_model_path, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # (the probe of the worker's parameter addresses)
    out = asyncio.run(_scenario(str(demo_model_path)))
    assert out["check"].direct, out["check"]
    assert out["metrics"]["weightsync/apply_direct"] == 1.0
    assert out["same_addresses"]  # copied into the live storage: captured CUDA graphs still point at it
    _assert_transformers_argmax(str(demo_model_path), out["new"], out["prompts"], list(zip(out["tokens"], out["versions"])))


class _SenderOnGpu1:
    """The learner-group calls a `CollectiveLink` makes, answered in this process by a learner rank's
    `SenderEndpoint` on cuda:1 (each call in a thread of its own: the CUDA device is per thread;
    `gpu` None: this process's own device, for a gloo run of the same scenario)."""

    def __init__(self, weights: dict, plan, gpu: int | None = 1) -> None:
        from asyncrl.weightsync.link import SenderEndpoint

        self.endpoint, self.weights, self.gpu = SenderEndpoint(), weights, gpu
        self.endpoint.set_plan(pickle.dumps(plan))

    async def _on_gpu1(self, fn, *args):
        import contextlib

        def run():
            with torch.cuda.device(self.gpu) if self.gpu is not None else contextlib.nullcontext():
                return fn(*args)
        return await asyncio.to_thread(run)

    async def collective_addresses(self):
        return [self.endpoint.address("127.0.0.1", 0)]

    async def join_collective(self, wire):
        return [await self._on_gpu1(self.endpoint.join, wire, 0, 0)]

    async def export_weights(self, bucket_mb, transport, verify, layout, timeout_s, gate=""):
        return await self._on_gpu1(self.endpoint.send_version, iter(self.weights.items()), bucket_mb, verify, timeout_s, 0,
                                   self.endpoint.plan, gate, transport)

    async def take_host_copies(self, timeout_s):
        out = await asyncio.to_thread(self.endpoint.take_host_copies, timeout_s)
        return out.buckets, out.seconds


async def _nccl_scenario(model_path: str, monkeypatch, backend: str = "nccl") -> dict:
    from asyncrl.config import GeneratorConfig, ModelConfig, WeightsyncConfig
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.types import GenerationRequest, Refusal, SamplingParams
    from asyncrl.weightsync.collective import CollectiveGroup
    from asyncrl.weightsync.link import CollectiveLink
    from asyncrl.weightsync.push import Pusher, VersionRegistry, WeightsyncError
    from asyncrl.weightsync.service import select_channel

    replica = EngineReplica(ModelConfig(path=model_path, max_model_len=256),
                            GeneratorConfig(engine_kwargs={"gpu_memory_utilization": 0.3} if torch.cuda.is_available() else {}),
                            replica_id="gpu0")
    await replica.start()  # the engine core on cuda:0
    try:
        base, plan = await _plan_for(replica, model_path)
        new = _perturbed(base)
        sender = _SenderOnGpu1(new, plan, 1 if backend == "nccl" else None)

        async def members():
            return {"gpu0": await replica.join_collective()}

        async def join(wire):
            return [await replica.join_collective(wire, 120.0)]

        cfg = WeightsyncConfig(transport=backend, bucket_mb=0.5, verify="checksum", timeout_s=120)
        link = CollectiveLink(backend, sender, members=members, join=join, bucket_mb=cfg.bucket_mb, timeout_s=cfg.timeout_s)
        pub = Pusher(cfg, transport=select_channel(cfg, on_gpu=backend == "nccl"), registry=VersionRegistry(0))
        client = LocalClient(replica)

        async def push(version):
            return await pub.push(version, streamed(pub, link, plan.plan_id), [client])

        prompts = [[5, 17, 9, 33, 2], [12, 4, 4, 7]]
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=False)

        async def greedy():
            outs = [await replica.generate(GenerationRequest(prompt_ids=p, sampling=sp)) for p in prompts]
            return [(o.completions[0].token_ids, o.completions[0].versions) for o in outs]

        result = await push(1)
        served = await greedy()
        # The sender's first broadcast of bucket bytes goes out with a byte flipped, after it hashed them
        # (a whole version enqueues its header, then its table, then the buckets).
        enqueue, calls = CollectiveGroup.enqueue_broadcasts, []

        def corrupting(self, tensors, deadline, **kw):
            if self.rank == 0:
                calls.append(len(tensors))
                if len(calls) == 3:
                    bad = tensors[0].clone()
                    bad[0] ^= 0x40
                    tensors = [bad, *tensors[1:]]
            return enqueue(self, tensors, deadline, **kw)

        monkeypatch.setattr(CollectiveGroup, "enqueue_broadcasts", corrupting)
        sender.weights = {n: t * 1.01 for n, t in new.items()}
        refusals = None
        try:
            await push(2)
        except WeightsyncError as err:
            refusals = set(err.refusals.values())
        monkeypatch.setattr(CollectiveGroup, "enqueue_broadcasts", enqueue)
        out = {"metrics": result.metrics, "new": new, "prompts": prompts, "served": served,
               "refused": refusals == {Refusal.VERIFY_FAILED}, "rollbacks": pub.totals["rollbacks_total"],
               "live": pub.registry.live_version, "after": await greedy()}
        out["third"] = (await push(3)).metrics  # the groups carry the next push
        out["live_after"] = pub.registry.live_version
        return out
    finally:
        replica.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL sender needs a GPU of its own: two GPUs")
def test_an_nccl_push_into_a_gpu_engine_applies_at_its_commit_and_refuses_a_corrupt_one(
        demo_model_path, ray_session, monkeypatch):
    """One engine replica (cuda:0) takes a push from a sending rank on cuda:1 over NCCL, full staging in
    its layout: it stages every bucket, then its commit checks the fingerprint, pauses, copies the version
    into its live weights, relabels and resumes; it decodes transformers' argmax tokens for the pushed
    weights. A byte flipped on the wire after the sender hashed it fails that check: nothing applied, and
    it serves version 1's exact tokens again."""
    out = asyncio.run(_nccl_scenario(str(demo_model_path), monkeypatch))
    m = out["metrics"]
    assert m["weightsync/apply_direct"] == 1.0 and m["weightsync/num_buckets"] > 1
    _assert_transformers_argmax(str(demo_model_path), out["new"], out["prompts"], out["served"])
    assert out["refused"] and out["rollbacks"] == 0 and out["live"] == 1
    assert out["after"] == out["served"]  # version 1's exact tokens and tags


def test_a_gloo_push_from_the_host_into_a_gpu_engine_applies_at_its_commit_and_refuses_a_corrupt_one(
        demo_model_path, ray_session, monkeypatch):
    """One GPU: a gloo sender on the host, the engine (cuda:0) staging every bucket on the device, its commit
    checking the fingerprint, then paused, applied, relabelled and resumed: transformers' argmax tokens for the
    pushed weights. A byte flipped on the wire fails that check: nothing applied, the previous version's exact
    tokens; the next push is carried."""
    out = asyncio.run(_nccl_scenario(str(demo_model_path), monkeypatch, backend="gloo"))
    m = out["metrics"]
    assert m["weightsync/apply_direct"] == 1.0 and m["weightsync/num_buckets"] > 1
    _assert_transformers_argmax(str(demo_model_path), out["new"], out["prompts"], out["served"])
    assert out["refused"] and out["rollbacks"] == 0 and out["live"] == 1
    assert out["after"] == out["served"]
    assert out["third"]["weightsync/apply_direct"] == 1.0 and out["live_after"] == 3


async def _ipc_scenario(model_path: str) -> dict:
    """One engine replica (cuda:0) and a sending rank's `SenderEndpoint` in this process on the same GPU, over ipc:
    three pushes, the second's bytes changed in the sender's buffers after it hashed them."""
    from asyncrl.config import GeneratorConfig, ModelConfig, WeightsyncConfig
    from asyncrl.generator.engine import EngineReplica
    from asyncrl.types import GenerationRequest, Refusal, SamplingParams
    from asyncrl.weightsync.link import CollectiveLink
    from asyncrl.weightsync.push import Pusher, VersionRegistry, WeightsyncError
    from asyncrl.weightsync.service import select_channel

    replica = EngineReplica(ModelConfig(path=model_path, max_model_len=256),
                            GeneratorConfig(engine_kwargs={"gpu_memory_utilization": 0.3}), replica_id="gpu0")
    await replica.start()
    try:
        base, plan = await _plan_for(replica, model_path)
        new = _perturbed(base)
        sender = _SenderOnGpu1(new, plan, 0)
        cfg = WeightsyncConfig(transport="ipc", bucket_mb=0.5, verify="checksum", timeout_s=120)
        link = CollectiveLink("ipc", sender, members=None, join=None, bucket_mb=cfg.bucket_mb, timeout_s=cfg.timeout_s)
        pub = Pusher(cfg, transport=select_channel(cfg, on_gpu=True), registry=VersionRegistry(0))
        prompts = [[5, 17, 9, 33, 2], [12, 4, 4, 7]]
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=False)

        async def push(version):
            return await pub.push(version, streamed(pub, link, plan.plan_id), [LocalClient(replica)])

        async def greedy():
            outs = [await replica.generate(GenerationRequest(prompt_ids=p, sampling=sp)) for p in prompts]
            return [(o.completions[0].token_ids, o.completions[0].versions) for o in outs]

        first = await push(1)
        served = await greedy()
        export = sender.export_weights

        async def corrupted(*args):  # a byte of the sender's buffers changed after it hashed them
            out = await export(*args)
            sender.endpoint.ring.arena[:1].bitwise_xor_(0x40)
            return out

        sender.export_weights, sender.weights = corrupted, {n: t * 1.01 for n, t in new.items()}
        refusals = None
        try:
            await push(2)
        except WeightsyncError as err:
            refusals = set(err.refusals.values())
        sender.export_weights = export
        out = {"metrics": first.metrics, "new": new, "prompts": prompts, "served": served,
               "refused": refusals == {Refusal.VERIFY_FAILED}, "live": pub.registry.live_version, "after": await greedy()}
        out["third"] = (await push(3)).metrics
        out["live_after"] = pub.registry.live_version
        await pub.drain()  # the host copy of version 3, made from the sender's buffers
        out["host_copy"] = pub._host is not None and pub._host.version == 3
        return out
    finally:
        replica.shutdown()


def test_an_ipc_push_into_an_engine_on_the_same_gpu_applies_at_its_commit_and_refuses_a_corrupt_one(
        demo_model_path, ray_session):
    """ipc: the sender packs into its ring and answers handles; the engine's load opens them (views, no copy), its
    commit checks the fingerprint, pauses, copies into its live weights and resumes: transformers' argmax tokens
    for the pushed weights. Bytes changed in the sender's buffers after it hashed them fail that check: nothing
    applied, version 1's exact tokens; the next push is carried, and its host copy kept."""
    out = asyncio.run(_ipc_scenario(str(demo_model_path)))
    m = out["metrics"]
    assert m["weightsync/apply_direct"] == 1.0 and m["weightsync/num_buckets"] > 1 and m["weightsync/transport/ipc/bytes"] > 0
    _assert_transformers_argmax(str(demo_model_path), out["new"], out["prompts"], out["served"])
    assert out["refused"] and out["live"] == 1 and out["after"] == out["served"]
    assert out["third"]["weightsync/apply_direct"] == 1.0 and out["live_after"] == 3 and out["host_copy"]
