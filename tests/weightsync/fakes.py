"""Small in-process replicas and transports for the push-logic tests (no engine, no Ray)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.types import CommitReport, LoadReport, Refusal, UpdateAck, UpdateBegin
from asyncrl.weightsync.bucket import Bucket, unpack_bucket
from asyncrl.weightsync.fingerprint import tensor_fingerprint
from asyncrl.weightsync.shm import SharedBucket
from asyncrl.weightsync.sources import BucketSource
from asyncrl.weightsync.transport import Channel, is_object_ref


class LocalChannel(Channel):
    """In-process: the handle is the bucket itself (replicas in this process, no Ray)."""

    name = "local"

    def put(self, bucket: Bucket) -> Bucket:
        return bucket

    def payload(self, handle: Bucket) -> Bucket:
        return handle

    def fetch(self, handle: Bucket) -> Bucket:
        return handle

    def release(self, handle: Bucket) -> None:
        return None


class Fault(Exception):
    def __init__(self, message: str, refusal: Refusal | None = None) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass
class FakeReplica:
    """Stages by name, verifies the fingerprint at commit before applying, like the generator's
    replica. `faults` maps (step, attempt) -> "raise" | "refuse" | "hang" | "partial"."""

    fanout = 1  # (one engine replica per client)
    name: str
    log: list[tuple[str, str]]
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int = 0
    faults: dict[tuple[str, int], str] = field(default_factory=dict)
    allow_reload: bool = True
    paused: bool = False
    attempt: int = 0  # counts the updates begun
    verify: str = "full"
    staged: dict[str, torch.Tensor] | None = None
    loads: int = 0

    async def _maybe_fault(self, step: str) -> None:
        kind = self.faults.get((step, self.attempt)) or self.faults.get((step, -1))
        if kind == "raise":
            raise Fault(f"injected {step} failure on {self.name}")
        if kind == "refuse":  # as a replica without the push's plan refuses it
            raise Fault(f"{self.name} holds no push plan", Refusal.PLAN_MISSING)
        if kind == "hang":
            await asyncio.Event().wait()

    async def pause(self, mode: str) -> None:
        self.log.append((self.name, f"pause:{mode}"))
        self.paused = True

    async def _begin(self, version: int, begin: UpdateBegin) -> None:
        """An update's first load begins it (logged as a step of its own: the tests read the update's order)."""
        self.log.append((self.name, f"begin:{version}"))
        self.verify = begin.verify
        self.attempt += 1
        if version <= self.version and not self.allow_reload:
            raise Fault(f"version {version} must be > current {self.version}")
        await self._maybe_fault("begin")
        self.staged = {}

    async def load_bucket(self, payload: Any, version: int, begin: UpdateBegin | None = None) -> LoadReport:
        """The whole version in one load, as the replica takes it: its buckets (shm files, buckets or ObjectRefs)."""
        if begin is not None:
            await self._begin(version, begin)
        self.log.append((self.name, "load"))
        self.loads += 1
        await self._maybe_fault("load")
        assert self.staged is not None, "load before begin"
        count = 0
        for bucket in payload if isinstance(payload, list) else [payload]:
            if is_object_ref(bucket):
                bucket = await bucket
            if isinstance(bucket, SharedBucket):  # the shm transport's payload: map the file
                bucket = bucket.open()
            tensors = unpack_bucket(bucket)
            for name, t in tensors:
                self.staged[name] = t.clone()
            count += len(tensors)
        return LoadReport(replica_id=self.name, staged_tensors=count)

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport:
        self.log.append((self.name, f"commit:{version}"))
        staged, self.staged = self.staged, None
        actual = tensor_fingerprint(staged or {}, self.verify)
        if actual != fingerprint:
            raise Fault(f"fingerprint mismatch for version {version}", Refusal.VERIFY_FAILED)
        if not self.paused:
            self.log.append((self.name, "own-pause"))
        if self.faults.get(("commit", self.attempt)) == "partial":
            first = sorted(staged)[0]
            self.weights[first] = staged[first]  # half applied, then the engine blew up
            raise Fault("reload_weights crashed")
        await self._maybe_fault("commit")
        self.weights, self.version = dict(staged), version
        return CommitReport(replica_id=self.name, version=version, path="reload")

    async def abort_update(self) -> UpdateAck:
        self.log.append((self.name, "abort"))
        self.staged = None
        return UpdateAck(replica_id=self.name, version=self.version)

    async def resume(self) -> None:
        self.log.append((self.name, "resume"))
        self.paused = False


class CorruptingChannel(LocalChannel):
    """Flips one byte of bucket `index` in what replicas receive (the publisher's copy is intact)."""

    def __init__(self, index: int = 0) -> None:
        self.index, self._puts = index, []

    def put(self, bucket: Bucket) -> Bucket:
        self._puts.append(bucket)
        return bucket

    def payload(self, handle: Bucket) -> Any:
        if not any(b is handle for b in self._puts[self.index : self.index + 1]):
            return handle
        buf = handle.buffer.copy()
        buf[0] ^= 0xFF
        return Bucket(buffer=buf, metas=list(handle.metas))


def plan_request(tensors: Any, bucket_mb: float) -> Any:
    """What the service asks the replicas to form their push plan from, for an export of `tensors` ({name: tensor},
    or the manifest itself)."""
    from asyncrl.types import PlanRequest
    from asyncrl.weightsync.plan import ManifestEntry
    from asyncrl.weightsync.service import dump_manifest

    manifest = tensors if isinstance(tensors, list) else \
        [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors.items()]
    return PlanRequest(manifest=dump_manifest(manifest), bucket_mb=bucket_mb)


def iter_unpacked(buckets: Any) -> Any:
    """Every (name, tensor view) of `buckets`, in order."""
    for bucket in buckets:
        yield from unpack_bucket(bucket)


def source_of(pub: Any, named: Any, plan: Any = None) -> BucketSource:
    """`named` (HF name -> tensor, or (name, tensor) pairs) packed and put as the learner ranks do (in `plan`'s
    engine layout when given), as the `BucketSource` a push of `pub` (a `Pusher`) takes: shm and the object
    store by the learner's own packer, an in-process transport by its `put`."""
    transport, cfg = pub._transport, pub._cfg
    pairs = named.items() if isinstance(named, dict) else named
    if isinstance(transport, LocalChannel):
        from asyncrl.weightsync.bucket import iter_buckets
        from asyncrl.weightsync.plan import PlannedPacker

        packed = iter_buckets(pairs, cfg.bucket_mb) if plan is None else PlannedPacker(plan, 0, "cpu").pack(pairs)
        handles, digests = [transport.put(b) for b in packed], None
    else:
        from asyncrl.weightsync.shm import pack_into_transport

        kind = "shm" if transport.name == "shm" else "object_store"
        export = pack_into_transport(pairs, cfg.bucket_mb, kind, cfg.verify, plan)
        handles, digests = export.buckets, export.digests
    return BucketSource(handles, transport, cfg.verify, digests, None if plan is None else plan.plan_id)


def model(seed: int, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 16, generator=g) for i in range(n)}


class LocalClient:
    """A ReplicaClient over an in-process EngineReplica (the real engine, no Serve, no Ray)."""

    fanout = 1

    def __init__(self, replica) -> None:
        self.r, self.name = replica, replica.replica_id

    async def pause(self, mode):
        return await self.r.pause(mode)

    async def resume(self):
        return await self.r.resume()

    async def load_bucket(self, payload, version, begin=None):
        return await self.r.load_bucket(payload, version, begin)

    async def commit_update(self, version, fingerprint):
        return await self.r.commit_update(version, fingerprint)

    async def abort_update(self):
        return await self.r.abort_update()


async def param_addresses(replica: Any) -> list[list[int]]:
    """Where each vLLM worker's live parameters are (a direct apply keeps every address): a function run in every
    worker through vLLM's `collective_rpc`, which ships a callable only with VLLM_ALLOW_INSECURE_SERIALIZATION set
    (before the engine starts). A test probe, not a weight verb."""
    return await replica.engine.llm.collective_rpc(
        lambda worker: [p.data_ptr() for p in worker.model_runner.get_model().parameters()])


def streamed(pub: Any, link: Any, plan_id: str | None = None) -> Any:
    """A collective push's source for `pub` (a `Pusher`): `link`'s senders broadcast into the replicas."""
    from asyncrl.weightsync.sources import StreamedSource

    return StreamedSource(link, pub._transport, pub._cfg.timeout_s, pub._cfg.verify, plan_id)
