"""The receiving half of a push at the engine replica: hand each payload to the workers, collect their digests, check
the fingerprint before anything is applied, then apply.

Owns: `ReplicaStaging`, the weight-update part of an engine replica (generator/engine.py keeps the replica's lifecycle,
pause/resume and version label, and calls this). Payloads it stages: a `SharedBucket` (shm), a `Bucket` (object
store: written once into a shared file), a `CollectiveReceive` (the workers receive from the senders themselves) or
loose named tensors, each optionally `WithDigests` (the sender's digests, for bucketed staging). The workers are
reached through `rpc(verb, *args, timeout=None)` -> one result per worker (`asyncrl.interfaces.WorkerAPI`'s verbs).
Must never: apply a staged version whose fingerprint differs, or touch the version label.
Details: docs/design/weightsync.md, "Replica staging".
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.interfaces import WorkerAPI, verb_name
from asyncrl.types import ApplyReport, LayoutCheck, ReceiveReport, Refusal
from asyncrl.weightsync.collective import CollectiveReceive
from asyncrl.weightsync.fingerprint import combine_digests, fingerprint_mode

log = logging.getLogger(__name__)

Rpc = Callable[..., Awaitable[list[Any]]]


class PlanMissing(ValueError):
    """An engine-layout push for a plan this replica does not hold (it started later): the
    publisher forms the plan again."""

    refusal = Refusal.PLAN_MISSING


class FingerprintMismatch(ValueError):
    """The staged tensors do not hash to the committed fingerprint; nothing was applied."""

    refusal = Refusal.VERIFY_FAILED


@dataclass(frozen=True)
class WithDigests:
    """A payload with the sender's digests of its tensors (bucketed staging checks each bucket
    against them before applying it)."""

    payload: Any
    digests: dict[str, bytes]


async def _as_shared(payload: Any) -> AsyncIterator[tuple[Any, bool]]:
    """The payload as shared bucket files for the workers, with whether this replica wrote (and
    so must unlink) each."""
    from asyncrl.weightsync.bucket import Bucket, SharedBucket, iter_buckets, write_shared

    if isinstance(payload, SharedBucket):
        yield payload, False
        return
    if isinstance(payload, Bucket):
        buckets: Any = [payload]
    else:  # iter_buckets checks the names and brings each tensor to contiguous CPU memory
        pairs = payload.items() if isinstance(payload, Mapping) else payload
        buckets = iter_buckets(pairs, 256.0)
    for bucket in buckets:
        yield await asyncio.to_thread(write_shared, bucket), True


class ReplicaStaging:
    def __init__(self, rpc: Rpc, replica_id: str) -> None:
        self.rpc, self.replica_id = rpc, replica_id
        self.plan_id: str | None = None
        self.layout_report: list[LayoutCheck] = []
        self.version: int | None = None
        self.layout = "hf"
        self.staging = "full"
        self._per_worker: list[dict[str, bytes]] = []
        self.verify = "full"

    # ---- layout and plan ---------------------------------------------------------------------
    async def check_layout(self) -> list[LayoutCheck]:
        self.layout_report = [msgspec.convert(c, LayoutCheck) for c in await self.rpc(WorkerAPI.asyncrl_check_layout, timeout=600.0)]
        return self.layout_report

    async def layouts(self, manifest: bytes) -> list[bytes]:
        return list(await self.rpc(WorkerAPI.asyncrl_layout, manifest, timeout=600.0))

    async def set_plan(self, plan: bytes | None) -> str | None:
        """Hand the workers a push plan (pickled); each checks its own layout is the plan's."""
        self.plan_id = None
        ids = set(await self.rpc(WorkerAPI.asyncrl_set_plan, plan, timeout=600.0))
        if len(ids) != 1:
            raise ValueError(f"workers disagree on the push plan: {sorted(map(str, ids))}")
        self.plan_id = ids.pop()
        return self.plan_id

    # ---- one update ------------------------------------------------------------------------------
    async def begin(self, version: int, verify: str, staging: str = "full", layout: str = "hf",
                    plan_id: str | None = None) -> None:
        """Start staging `version` on every worker."""
        if layout == "engine" and (self.plan_id is None or (plan_id is not None and plan_id != self.plan_id)):
            raise PlanMissing(f"an engine-layout push for plan {plan_id} but this replica holds plan {self.plan_id}")
        await self.rpc(WorkerAPI.asyncrl_begin_update, version, verify, staging, layout)
        self.version, self.layout, self.staging, self.verify = version, layout, staging, verify
        self._per_worker = []

    async def refuse(self, payload: Any, why: str) -> None:
        """A collective push this replica will not take (its begin was refused before the workers
        heard of it): the workers tell the sender (ipc), or close the push's gate (gloo / NCCL): every
        member stops at once instead of at its deadline."""
        if isinstance(payload, CollectiveReceive):
            await self.rpc(WorkerAPI.asyncrl_refuse_collective, list(payload.group_ids), why, payload.gate)

    def _merge(self, results: list[dict[str, bytes]]) -> None:
        if not self._per_worker:
            self._per_worker = [dict() for _ in results]
        for mine, got in zip(self._per_worker, results):
            mine.update(got)

    async def load(self, payload: Any, version: int) -> int:
        """Stage one payload on every worker; returns the tensors staged so far (all workers)."""
        if version != self.version:
            raise ValueError(f"bucket for version {version}, staging {self.version}")
        expected = None
        if isinstance(payload, WithDigests):
            payload, expected = payload.payload, payload.digests
            if is_object_ref(payload):  # nested in the wrapper, so Ray did not resolve it
                payload = await payload
        if isinstance(payload, CollectiveReceive):
            if payload.version != version:
                raise ValueError(f"collective push of version {payload.version}, staging {version}")
            results = await self.rpc(WorkerAPI.asyncrl_receive_collective, version, list(payload.group_ids),
                                     payload.timeout_s, payload.gate, timeout=payload.timeout_s + 30.0)
            results = [msgspec.convert(r, ReceiveReport) for r in results]
            self._per_worker = [dict(r.digests) for r in results]
        else:
            async for shared, owned in _as_shared(payload):
                try:
                    self._merge(await self.rpc(WorkerAPI.asyncrl_stage_file, version, shared.wire(), expected))
                finally:
                    if owned:  # written here; the workers hold their own mappings now
                        shared.unlink()
        return sum(len(d) for d in self._per_worker)

    def check(self, version: int, fingerprint: str) -> str:
        """Raise FingerprintMismatch unless what the workers staged hashes to `fingerprint`."""
        if version != self.version:
            raise FingerprintMismatch(f"fingerprint mismatch for version {version}: staging {self.version}")
        try:
            mode = fingerprint_mode(fingerprint)
        except ValueError as err:
            raise FingerprintMismatch(f"fingerprint mismatch for version {version}: {err}") from None
        if self.layout == "engine":  # each rank staged its own parameters (keys carry the rank)
            union: dict[str, bytes] = {}
            for d in self._per_worker:
                union.update(d)
            candidates = [union]
        else:  # every worker staged every HF tensor
            candidates = self._per_worker or [{}]
        for digests in candidates:
            actual = combine_digests(digests, mode)
            if actual != fingerprint:
                raise FingerprintMismatch(f"fingerprint mismatch for version {version}: expected {fingerprint[:24]}, "
                                          f"staged tensors hash to {actual[:24]}")
        return fingerprint

    async def apply(self, version: int, before: Callable[..., Any] | None = None) -> ApplyReport:
        """Apply the staged version on every worker. `before`: a `WorkerAPI` verb (no arguments)
        each worker calls first, in the same round trip (the engine reads its paused state so);
        its results, one per worker, come back as "before"."""
        t = time.perf_counter()
        try:
            if before is None:
                results, first = await self.rpc(WorkerAPI.asyncrl_apply, version, timeout=600.0), []
            else:
                pairs = await self.rpc(WorkerAPI.asyncrl_apply_after, version, verb_name(WorkerAPI, before), timeout=600.0)
                first, results = [p[0] for p in pairs], [p[1] for p in pairs]
        finally:
            self.version, self._per_worker = None, []
        results = [msgspec.convert(r, ApplyReport) for r in results]
        return ApplyReport(path=results[0].path if results else "none",
                           apply_seconds=max((r.apply_seconds for r in results), default=0.0),
                           rpc_seconds=time.perf_counter() - t, before=first)

    async def abort(self) -> None:
        await self.rpc(WorkerAPI.asyncrl_abort_update)
        self.version, self._per_worker = None, []


def is_object_ref(value: Any) -> bool:
    """A Ray object handle that travelled nested in another value (Ray resolves only top-level arguments)."""
    import ray

    return isinstance(value, ray.ObjectRef)


def dump_manifest(manifest: Any) -> bytes:
    return pickle.dumps(list(manifest), protocol=pickle.HIGHEST_PROTOCOL)


async def adopt_push_plan(plan: Any, staging: ReplicaStaging, replica_id: str) -> str | None:
    """A replica that starts after the push plan was formed takes it (from the WeightStore), so the
    next push finds it holding that plan. Without it that push was refused (PLAN_MISSING): a failed
    attempt, then a plan formed again with every replica (an autoscaled replica that came up between
    the plan and the first push). A plan this replica's workers refuse (their
    layout is not the plan's) is left alone: the next push is refused and the service forms a plan
    with this replica. Returns the plan id held after."""
    if plan is None or plan.plan_id == staging.plan_id:
        return staging.plan_id
    try:
        return await staging.set_plan(pickle.dumps(plan))
    except Exception as err:  # its layout differs: the service's PLAN_MISSING path handles it
        log.info("replica %s: the push plan %s does not fit this engine (%s); the next push forms one with it",
                 replica_id, plan.plan_id, err)
        return None
