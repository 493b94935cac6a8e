"""One engine replica's weight-update state (`WeightUpdates`), owned by the replica (engine.py).

Owns: the push plan the replica holds, a version's staging (begin, the workers' receive, their digests), its check
against the committed fingerprint, the workers' apply or drop, the replica's collective groups. Payloads: a
`CollectiveReceive` (the workers receive from the senders), or a list of `SharedBucket`s, `IpcBucket`s, `Bucket`s
(each written once into a shared file) or loose named tensors. The workers' half is weightsync's worker_verbs.py;
the replica's commit (pause, apply, relabel, resume) is engine.py's. It reaches the workers only through `rpc`.
Must never: apply staged tensors whose fingerprint differs from the one the caller committed, or stage anything
after a refused begin. Details: docs/design/generator.md, "The replica's weight updates".
"""
from __future__ import annotations

import asyncio
import logging
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from asyncrl.generator.replica_types import UpdateState, WeightUpdateError
from asyncrl.interfaces import WorkerAPI, verb_name
from asyncrl.types import ApplyReport, GroupsReport, LayoutCheck, LoadReport, PlanAck, PlanRequest, ReceiveReport, Refusal, UpdateBegin, refusal_of
from asyncrl.weightsync.bucket import Bucket, iter_buckets
from asyncrl.weightsync.collective import CollectiveReceive
from asyncrl.weightsync.fingerprint import check_verify_mode, combine_digests, fingerprint_mode
from asyncrl.weightsync.ipc import IpcBucket
from asyncrl.weightsync.plan import PlanError, build_plan, plan_misfit
from asyncrl.weightsync.shm import SharedBucket, write_shared
from asyncrl.weightsync.transport import is_object_ref

logger = logging.getLogger(__name__)


class PlanMissing(ValueError):
    """An engine-layout push for a plan this replica does not hold (it started later): the publisher forms it again."""

    refusal = Refusal.PLAN_MISSING


class FingerprintMismatch(ValueError):
    """The staged tensors do not hash to the committed fingerprint; nothing was applied."""

    refusal = Refusal.VERIFY_FAILED


class WeightUpdates:
    """One replica's weight-update state: the push plan it holds, the version being staged and what each worker
    staged, the collective groups its workers joined. It reaches the workers only through `rpc`; the replica
    (engine.py) calls it under its control lock and owns the pause, the version label and the lifecycle."""

    def __init__(self, replica_id: str, worker_call: Callable[[str, tuple, float | None], Awaitable[list[Any]]]) -> None:
        self.replica_id, self._worker_call = replica_id, worker_call  # (the engine driver's `worker_call`)
        self.state = UpdateState.IDLE
        self.staging_version: int | None = None
        self._begin_args: list[Any] = []  # (verify, layout, plan id) of the version staged: the workers' begin
        self._staged: list[dict[str, bytes]] = []  # per worker: the digests of what it staged
        self.plan_id: str | None = None  # the push plan held (its engine-layout buckets copy in; workers learn it at begin)
        self.layout_checks: list[LayoutCheck] = []  # the start-time check of the engine's parameter layout
        # the last join's answer (None: ask them); a group breaks only in a receive, whose failed load drops it
        self._groups_joined: GroupsReport | None = None

    async def rpc(self, verb: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run the worker verb `verb` (by reference: `WorkerAPI.asyncrl_apply`) on every worker; one answer each."""
        return await self._worker_call(verb_name(WorkerAPI, verb), args, timeout)

    async def check_layout(self) -> list[LayoutCheck]:
        """Whether each worker can copy pushed tensors into its live parameters (at start)."""
        checks = await self.rpc(WorkerAPI.asyncrl_layout, timeout=600.0)
        self.layout_checks = [msgspec.convert(c, LayoutCheck) for c in checks]
        return self.layout_checks

    async def form_plan(self, request: PlanRequest | None) -> PlanAck:
        """Form the push plan of the export `request` describes from the workers' layouts for it, and hold it: its
        buckets are applied by a copy from then on. None, or no plan fits: pushes reload (`problem` says why)."""
        plan, why = None, "no plan asked for"
        if request is not None:
            try:
                plan, why = build_plan(pickle.loads(request.manifest), await self._layouts(request.manifest),
                                       request.bucket_mb), ""
            except PlanError as err:
                why = str(err)
        self.plan_id = plan.plan_id if plan is not None else None
        return PlanAck(replica_id=self.replica_id, plan_id=self.plan_id, plan=pickle.dumps(plan) if plan is not None else None,
                       problem=why)

    async def _layouts(self, manifest: bytes) -> list[Any]:
        """Each worker's `EngineLayout` for the learner's export `manifest` (pickled `ManifestEntry`s)."""
        answers = await self.rpc(WorkerAPI.asyncrl_layout, manifest, timeout=600.0)
        return [pickle.loads(msgspec.convert(a, LayoutCheck).layout) for a in answers]

    async def take_plan(self, plan: Any) -> str:
        """Hold `plan`, formed elsewhere, if every worker's layout is the plan's; else PlanError says why not."""
        problem = plan_misfit(plan, await self._layouts(pickle.dumps(list(plan.manifest))))
        if problem:
            raise PlanError(problem)
        self.plan_id = plan.plan_id
        return self.plan_id

    async def adopt_plan(self, plan: Any) -> str | None:
        """A replica started after the push plan was formed takes it (from the WeightStore), so its next push is
        not refused as PLAN_MISSING. A plan its workers' layout does not fit is not held: the next push is refused
        and the service forms a plan with this replica. Returns the plan id held after."""
        if plan is None or plan.plan_id == self.plan_id:
            return self.plan_id
        try:
            return await self.take_plan(plan)
        except Exception as err:  # its layout differs: the service's PLAN_MISSING path handles it
            logger.info("replica %s: the push plan %s does not fit this engine (%s); the next push forms one with it",
                        self.replica_id, plan.plan_id, err)
            self.plan_id = None
            return None

    def begin(self, version: int, begin: UpdateBegin, serving: int) -> None:
        """Start staging `version` (dropping any staged copy) on a replica serving `serving`; its buckets are hashed
        as they arrive in `begin.verify` mode (weightsync/fingerprint.py). The workers start at the first receive."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:  # (any client may call the verb)
            raise WeightUpdateError(f"replica {self.replica_id}: version {version!r} must be an int >= 0")
        plan_id = begin.plan_id
        try:
            check_verify_mode(begin.verify)
            if begin.layout not in ("hf", "engine"):
                raise ValueError(f"layout {begin.layout!r} is not 'hf' or 'engine'")
            if begin.layout == "engine" and (self.plan_id is None or (plan_id is not None and plan_id != self.plan_id)):
                raise PlanMissing(f"an engine-layout push for plan {plan_id} but this replica holds plan {self.plan_id}")
        except ValueError as err:
            raise WeightUpdateError(f"replica {self.replica_id}: {type(err).__name__}: {err}", refusal_of(err)) from None
        if version <= serving:
            # weightsync restoring the last live version after a torn push: the label goes back with the
            # weights, so tokens stay truthfully tagged
            logger.warning("replica %s: staging version %d while serving %d (restore)", self.replica_id, version, serving)
        self.state, self.staging_version = UpdateState.STAGING, version
        self._staged = []
        self._begin_args = [begin.verify, begin.layout, self.plan_id if begin.layout == "engine" else None]

    async def load(self, named_tensors: Any, version: int, begin: UpdateBegin, serving: int) -> LoadReport:
        """Stage `version` from a payload (a `CollectiveReceive`, or a list of shared files, buckets or their
        ObjectRefs); `begin` starts the update (a refused begin stages nothing)."""
        try:
            self.begin(version, begin, serving)
        except Exception as err:
            # a broadcast's other members wait at its gate until this replica's workers receive or refuse: they
            # refuse (closing the gate), best effort and bounded (a worker stuck elsewhere must not hold this back)
            if isinstance(named_tensors, CollectiveReceive):
                self._groups_joined = None  # ask the workers next time
                try:
                    await asyncio.wait_for(self.rpc(WorkerAPI.asyncrl_abort_update, list(named_tensors.group_ids),
                                                    f"replica {self.replica_id}: {err}", named_tensors.gate), 30.0)
                except Exception as refuse_err:  # noqa: BLE001 - the load's own failure is the one reported
                    logger.warning("replica %s: could not refuse the push: %s", self.replica_id, refuse_err)
            raise
        try:  # the workers receive, or refuse, from here on
            await self._stage(named_tensors, version)
        except Exception as err:
            self._groups_joined = None  # a failed receive may have broken a worker's group
            await self.drop()
            raise WeightUpdateError(f"replica {self.replica_id}: staging failed: {err}") from err
        return LoadReport(replica_id=self.replica_id, staged_tensors=sum(len(d) for d in self._staged))

    async def _stage(self, payload: Any, version: int) -> None:
        """Stage the version on every worker, one receive each (digests kept per worker)."""
        if isinstance(payload, CollectiveReceive):
            if payload.version != version:
                raise ValueError(f"collective push of version {payload.version}, staging {version}")
            results = await self.rpc(WorkerAPI.asyncrl_receive, version, None, list(payload.group_ids),
                                     payload.timeout_s, payload.gate, self._begin_args, timeout=payload.timeout_s + 30.0)
        else:
            files: list[tuple[Any, bool]] = []
            try:
                for item in payload if isinstance(payload, list) else [payload]:
                    item = await item if is_object_ref(item) else item  # (in a list, Ray resolved none of them)
                    if isinstance(item, (SharedBucket, IpcBucket)):  # the workers map it (or open the sender's handles)
                        files.append((item, False))
                    else:  # a bucket, or {name: tensor} (made contiguous CPU tensors): written once into shared files
                        buckets = [item] if isinstance(item, Bucket) else iter_buckets(item.items(), 256.0)
                        files += [(await asyncio.to_thread(write_shared, bucket), True) for bucket in buckets]
                results = await self.rpc(WorkerAPI.asyncrl_receive, version, [f.wire() for f, _ in files], None, 0.0,
                                         "", self._begin_args)
            finally:
                for shared, owned in files:
                    if owned:  # written here; the workers hold their own mappings now
                        shared.unlink()
        self._staged = [dict(msgspec.convert(r, ReceiveReport).digests) for r in results]

    def check(self, version: int, fingerprint: str) -> None:
        """Raise FingerprintMismatch unless the workers staged `version` and it hashes to `fingerprint`; a
        WeightUpdateError if `version` is not the one staging."""
        if self.state is not UpdateState.STAGING or self.staging_version != version:
            raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} but staging "
                                    f"{self.staging_version}")
        try:
            mode = fingerprint_mode(fingerprint)
        except ValueError as err:
            raise FingerprintMismatch(f"fingerprint mismatch for version {version}: {err}") from None
        if self._begin_args[1] == "engine":  # each rank staged its own parameters (keys carry the rank)
            candidates = [{k: v for d in self._staged for k, v in d.items()}]
        else:  # every worker staged every HF tensor
            candidates = self._staged or [{}]
        for digests in candidates:
            actual = combine_digests(digests, mode)
            if actual != fingerprint:
                raise FingerprintMismatch(f"fingerprint mismatch for version {version}: expected {fingerprint[:24]}, "
                                          f"staged tensors hash to {actual[:24]}")

    async def apply(self, version: int, before: Callable[..., Any] | None = None) -> ApplyReport:
        """Apply the staged version on every worker; nothing is staged after, applied or not. `before`: a
        `WorkerAPI` verb (no arguments) each worker calls first, in the same round trip (so it reads the paused
        state); its answers, one per worker, are `before`."""
        self.state = UpdateState.COMMITTING
        query = "" if before is None else verb_name(WorkerAPI, before)
        try:
            results = [msgspec.convert(r, ApplyReport) for r in await self.rpc(WorkerAPI.asyncrl_apply, version, query,
                                                                             timeout=600.0)]
        finally:
            self.state, self.staging_version, self._staged = UpdateState.IDLE, None, []
        return ApplyReport(path=results[0].path if results else "none",
                           apply_seconds=max((r.apply_seconds for r in results), default=0.0),
                           before=[r.before[0] for r in results] if query else [])

    async def drop(self) -> None:
        """Drop what the workers staged (and the buffers a push kept open); nothing stages after, answered or not."""
        try:
            await self.rpc(WorkerAPI.asyncrl_abort_update)
        finally:
            self.state, self.staging_version, self._staged = UpdateState.IDLE, None, []

    # ---- collective transport groups (weightsync/collective.py) --------------------------------

    async def groups(self) -> GroupsReport:
        """How many workers this replica has (each one receiver rank) and which groups every one of them holds."""
        if self._groups_joined is not None:  # asked before every collective push: no round trip to the workers
            return self._groups_joined
        per_worker = await self.rpc(WorkerAPI.asyncrl_join_collective, self.replica_id)
        common = set(per_worker[0]).intersection(*map(set, per_worker[1:])) if per_worker else set()
        return GroupsReport(replica_id=self.replica_id, workers=len(per_worker), groups=sorted(common))

    async def join(self, specs: list[dict[str, Any]], timeout_s: float) -> GroupsReport:
        """Every worker joins the groups `specs` (concurrently with the senders)."""
        self._groups_joined = None
        joined = await self.rpc(WorkerAPI.asyncrl_join_collective, self.replica_id, list(specs), timeout=timeout_s + 30.0)
        # (every worker joined the same groups, or the call failed)
        self._groups_joined = GroupsReport(replica_id=self.replica_id, workers=len(joined), groups=sorted(joined[0]))
        return self._groups_joined
