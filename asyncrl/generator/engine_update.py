"""The engine replica's side of a weight push: its update state machine, from the payload to the paused apply.

Owns: load (it begins the update) -> commit (fingerprint check, pause, apply, relabel, resume) or abort, the workers'
staged digests, the replica's collective groups, the push plan it holds, and moving the per-token version labels at
a commit (through the replica's `VersionSource`). Payloads: a `CollectiveReceive` (the workers receive from the
senders), or a list of `SharedBucket`s, `IpcBucket`s, `Bucket`s (each written once into a shared file) or loose named
tensors. The workers' half is weightsync's worker_verbs.py. `WeightUpdates` is a part of `EngineReplica` (engine.py).
Must never: change the version label while the engine runs a step, or apply staged tensors whose fingerprint
differs from the one the caller committed. Details: docs/design/generator.md, "The replica's weight updates".
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.generator.replica_types import ReplicaState, UpdateState, WeightUpdateError
from asyncrl.interfaces import WorkerAPI, verb_name
from asyncrl.types import (
    ApplyReport,
    CommitReport,
    GroupsReport,
    LayoutCheck,
    LoadReport,
    PlanAck,
    PlanRequest,
    ReceiveReport,
    Refusal,
    UpdateAck,
    UpdateBegin,
    refusal_of,
)
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
    """The update protocol's verbs of an engine replica. `_init_weight_updates` sets its state; the replica
    (engine.py) provides `engine`, `version`, `state`, the pause and the control lock."""

    def _init_weight_updates(self) -> None:
        self.update_state = UpdateState.IDLE
        self._staging_version: int | None = None
        self._begin_args: list[Any] = []  # (verify, layout, plan id) of the version staged: the workers' begin
        self._staged: list[dict[str, bytes]] = []  # per worker: the digests of what it staged
        self.plan_id: str | None = None  # the push plan held (its engine-layout buckets copy in; workers learn it at begin)
        self.layout_checks: list[LayoutCheck] = []  # the start-time check of the engine's parameter layout
        # the last join's answer (None: ask them); a group breaks only in a receive, whose failed load_bucket drops it
        self._groups_joined: GroupsReport | None = None

    async def _rpc(self, verb: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run the worker verb `verb` (by reference: `WorkerAPI.asyncrl_apply`) on every worker; one answer each."""
        return await self.engine.worker_call(verb_name(WorkerAPI, verb), args, timeout)

    async def _check_layout(self) -> list[LayoutCheck]:
        """Whether each worker can copy pushed tensors into its live parameters (at start)."""
        checks = await self._rpc(WorkerAPI.asyncrl_layout, timeout=600.0)
        self.layout_checks = [msgspec.convert(c, LayoutCheck) for c in checks]
        return self.layout_checks

    async def set_push_plan(self, request: PlanRequest | None) -> PlanAck:
        """Form the push plan of the export `request` describes from the workers' layouts for it, and hold it: its
        buckets are applied by a copy from then on. None, or no plan fits: pushes reload (`problem` says why)."""
        async with self._control_lock:
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
        answers = await self._rpc(WorkerAPI.asyncrl_layout, manifest, timeout=600.0)
        return [pickle.loads(msgspec.convert(a, LayoutCheck).layout) for a in answers]

    async def _take_plan(self, plan: Any) -> str:
        """Hold `plan`, formed elsewhere, if every worker's layout is the plan's; else PlanError says why not."""
        problem = plan_misfit(plan, await self._layouts(pickle.dumps(list(plan.manifest))))
        if problem:
            raise PlanError(problem)
        self.plan_id = plan.plan_id
        return self.plan_id

    async def _adopt_plan(self, plan: Any) -> str | None:
        """A replica started after the push plan was formed takes it (from the WeightStore), so its next push is
        not refused as PLAN_MISSING. A plan its workers' layout does not fit is not held: the next push is refused
        and the service forms a plan with this replica. Returns the plan id held after."""
        if plan is None or plan.plan_id == self.plan_id:
            return self.plan_id
        try:
            return await self._take_plan(plan)
        except Exception as err:  # its layout differs: the service's PLAN_MISSING path handles it
            logger.info("replica %s: the push plan %s does not fit this engine (%s); the next push forms one with it",
                        self.replica_id, plan.plan_id, err)
            self.plan_id = None
            return None

    def _begin(self, version: int, begin: UpdateBegin) -> None:
        """Start staging `version` (dropping any staged copy); its buckets are hashed as they arrive in `begin.verify`
        mode (weightsync/fingerprint.py). The workers start at the update's first receive (`_stage`)."""
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
        if version <= self.version:
            # weightsync restoring the last live version after a torn push: the label goes back with the
            # weights, so tokens stay truthfully tagged
            logger.warning("replica %s: staging version %d while serving %d (restore)", self.replica_id, version, self.version)
        self.update_state, self._staging_version = UpdateState.STAGING, version
        self._staged = []
        self._begin_args = [begin.verify, begin.layout, self.plan_id if begin.layout == "engine" else None]

    async def load_bucket(self, named_tensors: Any, version: int, begin: UpdateBegin) -> LoadReport:
        """Stage `version` from a payload (a `CollectiveReceive`, or a list of shared files, buckets or their
        ObjectRefs); `begin` starts the update (a refused begin stages nothing)."""
        async with self._control_lock:
            try:
                self._begin(version, begin)
            except Exception as err:
                # a broadcast's other members wait at its gate until this replica's workers receive or refuse: they
                # refuse (closing the gate), best effort and bounded (a worker stuck elsewhere must not hold this back)
                if isinstance(named_tensors, CollectiveReceive):
                    self._groups_joined = None  # ask the workers next time
                    try:
                        await asyncio.wait_for(self._rpc(WorkerAPI.asyncrl_abort_update, list(named_tensors.group_ids),
                                                         f"replica {self.replica_id}: {err}", named_tensors.gate), 30.0)
                    except Exception as refuse_err:  # noqa: BLE001 - the load's own failure is the one reported
                        logger.warning("replica %s: could not refuse the push: %s", self.replica_id, refuse_err)
                raise
            try:  # the workers receive, or refuse, from here on
                await self._stage(named_tensors, version)
            except Exception as err:
                self._groups_joined = None  # a failed receive may have broken a worker's group
                await self._drop_staged()
                raise WeightUpdateError(f"replica {self.replica_id}: staging failed: {err}") from err
            return LoadReport(replica_id=self.replica_id, staged_tensors=sum(len(d) for d in self._staged))

    async def _stage(self, payload: Any, version: int) -> None:
        """Stage the version on every worker, one receive each (digests kept per worker)."""
        if isinstance(payload, CollectiveReceive):
            if payload.version != version:
                raise ValueError(f"collective push of version {payload.version}, staging {version}")
            results = await self._rpc(WorkerAPI.asyncrl_receive, version, None, list(payload.group_ids),
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
                results = await self._rpc(WorkerAPI.asyncrl_receive, version, [f.wire() for f, _ in files], None, 0.0,
                                          "", self._begin_args)
            finally:
                for shared, owned in files:
                    if owned:  # written here; the workers hold their own mappings now
                        shared.unlink()
        self._staged = [dict(msgspec.convert(r, ReceiveReport).digests) for r in results]

    def _check_staged(self, version: int, fingerprint: str) -> None:
        """Raise FingerprintMismatch unless what the workers staged hashes to `fingerprint`."""
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

    async def _apply_staged(self, version: int, before: Callable[..., Any] | None = None) -> ApplyReport:
        """Apply the staged version on every worker. `before`: a `WorkerAPI` verb (no arguments) each worker calls
        first, in the same round trip (so it reads the paused state); its answers, one per worker, are `before`."""
        query = "" if before is None else verb_name(WorkerAPI, before)
        results = [msgspec.convert(r, ApplyReport) for r in await self._rpc(WorkerAPI.asyncrl_apply, version, query,
                                                                          timeout=600.0)]
        return ApplyReport(path=results[0].path if results else "none",
                           apply_seconds=max((r.apply_seconds for r in results), default=0.0),
                           before=[r.before[0] for r in results] if query else [])

    # ---- collective transport groups (weightsync/collective.py) --------------------------------

    async def join_collective(self, specs: list[dict[str, Any]] | None = None, timeout_s: float = 120.0) -> GroupsReport:
        """Join the groups `specs` (every worker, concurrently with the senders); None: join nothing. Answers how many
        workers this replica has (each one receiver rank) and which groups every one of them holds."""
        if (dead := self.engine.dead()) is not None:  # (its workers hold no group a push could use)
            raise WeightUpdateError(f"replica {self.replica_id}: {dead}")
        if specs is None:
            if self._groups_joined is not None:  # asked before every collective push: no round trip to the workers
                return self._groups_joined
            per_worker = await self._rpc(WorkerAPI.asyncrl_join_collective, self.replica_id)
            common = set(per_worker[0]).intersection(*map(set, per_worker[1:])) if per_worker else set()
            return GroupsReport(replica_id=self.replica_id, workers=len(per_worker), groups=sorted(common))
        async with self._control_lock:
            self._groups_joined = None
            joined = await self._rpc(WorkerAPI.asyncrl_join_collective, self.replica_id, list(specs), timeout=timeout_s + 30.0)
            # (every worker joined the same groups, or the call failed)
            self._groups_joined = GroupsReport(replica_id=self.replica_id, workers=len(joined),
                                               groups=sorted(joined[0]))
            return self._groups_joined

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport:
        """Check the staged version against `fingerprint` (nothing applied if it differs), then, paused, apply it
        and relabel. A caller that did not pause is paused here, and resumed after a successful apply; a failed
        apply leaves the replica paused (weightsync restores the last live version, then resumes it)."""
        async with self._control_lock:
            if self.update_state is not UpdateState.STAGING or self._staging_version != version:
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} but staging "
                                        f"{self._staging_version}")
            if "weights" in self._asleep:
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} while its weights are "
                                        "asleep (wake_up(['weights']) first); nothing applied")
            try:
                self._check_staged(version, fingerprint)
            except FingerprintMismatch as err:
                self.counters["updates_failed"] += 1
                await self._drop_staged()
                raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} rejected, "
                                        f"staying on {self.version}: {err}", Refusal.VERIFY_FAILED) from None
            self.update_state = UpdateState.COMMITTING
            # The version label may only change while no step runs; pause here if the caller did not.
            paused_here = self.state is ReplicaState.READY and self._may_run()
            t_pause = time.perf_counter()
            if paused_here:
                await self._pause_engine("keep")
                self._paused_mode = "keep"  # held until the apply succeeded
            t_paused = time.perf_counter()
            try:
                # paused: no step runs, so the counts the workers read with the apply hold until resume
                applied = await self._apply_staged(version, before=self._versions.counts_query)
                sampled = await self._versions.counts(applied.before)
            except Exception as err:
                self.counters["updates_failed"] += 1
                raise WeightUpdateError(
                    f"replica {self.replica_id}: commit of version {version} failed while applying (possibly part "
                    f"applied; the replica stays paused until restored): {err}", applying=True
                ) from err
            finally:
                self.update_state, self._staging_version, self._staged = UpdateState.IDLE, None, []
            t_applied = time.perf_counter()
            await self.engine.relabel(version)
            if not paused_here:  # our own pause above cleared the caches, and nothing ran since
                await self.engine.reset_prefix_cache()
            self._versions.mark(version, sampled)  # no await between this and the label change
            self.version = version
            self._weights_discarded = False
            self.counters["updates_committed"] += 1
            # resume what this commit paused, or start an awake engine a level-2 sleep had left without weights
            if paused_here:
                self._paused_mode = None
            t_relabelled = time.perf_counter()
            if self.state is ReplicaState.READY and paused_here and self._may_run():
                await self._resume_sent()
            elif self.state is ReplicaState.READY and (paused_here or self._may_run()):
                await self._settle()
            end = time.perf_counter()
            apply_s = applied.apply_seconds
            return CommitReport(
                replica_id=self.replica_id, version=self.version, path=applied.path,
                # the paused window: the engine's pause, the workers' round trip (the apply in it), relabel, resume
                seconds={"apply": apply_s, "reload": apply_s if applied.path == "reload" else 0.0,
                         "paused": end - t_pause if paused_here else 0.0, "pause_call": t_paused - t_pause,
                         "apply_rpc": t_applied - t_paused, "relabel": t_relabelled - t_applied,
                         "resume_call": end - t_relabelled})

    async def _resume_sent(self) -> None:
        """Resume the engine this commit paused without awaiting its answer: the call is on the wire when this
        returns, so any later call (a pause, a request) reaches the engine after it. A failure is only logged (the
        engine is gone; its health check and the next push say so)."""
        task = asyncio.ensure_future(self._settle())

        def report(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is not None:
                logger.warning("replica %s: resume after a commit failed: %s", self.replica_id, done.exception())

        task.add_done_callback(report)
        self._resuming = task  # (kept referenced until it is done)
        await asyncio.sleep(0)

    async def abort_update(self) -> UpdateAck:
        async with self._control_lock:
            await self._drop_staged()
            return UpdateAck(replica_id=self.replica_id, version=self.version)

    async def _drop_staged(self) -> None:
        await self._rpc(WorkerAPI.asyncrl_abort_update)
        self.update_state, self._staging_version, self._staged = UpdateState.IDLE, None, []
