"""The engine replica's side of a weight push: its update state machine and the paused apply.

Owns: begin -> load bucket(s) -> commit (fingerprint check, pause, apply, relabel, resume) or abort, the replica's
collective-group membership, the push plan it accepts, and moving the per-token version labels at a commit
(through the replica's `VersionSource`). The wire's receiving half is weightsync's (replica_side.py, vllm_worker.py).
`WeightUpdates` is a part of `EngineReplica` (engine.py), which sets the attributes it reads.
Must never: change the version label while the engine runs a step, or apply staged tensors whose fingerprint
differs from the one the caller committed.
Details: docs/design/generator.md, "The replica's weight updates".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl.generator.replica_types import ReplicaState, UpdateState, WeightUpdateError
from asyncrl.interfaces import WorkerAPI, verb_name
from asyncrl.types import CommitReport, FingerprintReport, GroupsReport, LayoutReport, LoadReport, PlanAck, Refusal, UpdateAck, refusal_of
from asyncrl.weightsync import trace
from asyncrl.weightsync.collective import CollectiveReceive, is_gate_closed
from asyncrl.weightsync.fingerprint import check_verify_mode
from asyncrl.weightsync.replica_side import FingerprintMismatch, is_object_ref

logger = logging.getLogger(__name__)


class WeightUpdates:
    """The update protocol's verbs of an engine replica (see the module docstring)."""

    async def _rpc(self, verb: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Run the worker verb `verb` (by reference: `WorkerAPI.asyncrl_apply`) on every worker of the
        engine; one answer per worker. The driver takes the method's name (vLLM's collective_rpc):
        this is the one place that turns a worker verb into it."""
        return await self.engine.worker_call(verb_name(WorkerAPI, verb), args, timeout)

    async def engine_layout(self, manifest: bytes) -> LayoutReport:
        """Every worker's parameter layout for the learner's export `manifest` (pickled
        `EngineLayout`s, weightsync/plan.py), and what the start-time check found."""
        return LayoutReport(replica_id=self.replica_id, layouts=await self._staging.layouts(manifest),
                            check=list(self._staging.layout_report))

    async def set_push_plan(self, plan: bytes | None) -> PlanAck:
        """Engine-layout buckets of this push plan (pickled, weightsync/plan.py) may be applied by a
        copy from now on; every worker checks its own layout is the plan's. None: reload only."""
        async with self._control_lock:
            return PlanAck(replica_id=self.replica_id, plan_id=await self._staging.set_plan(plan))

    async def begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf",
                           plan_id: str | None = None) -> UpdateAck:
        """Start staging `version`; buckets are hashed as they arrive in `verify` mode (weightsync/fingerprint.py).
        `layout`: "engine" (packed for a copy into the parameters) or "hf"; `staging`: "full" or "bucketed"."""
        trace.mark("rep.begin")
        async with self._control_lock:
            return await self._begin(version, verify, staging, layout, plan_id)

    async def _begin(self, version: int, verify: str, staging: str, layout: str, plan_id: str | None,
                     with_receive: Any = None) -> UpdateAck:
        """`begin_update` under the control lock. `with_receive` (a `CollectiveReceive`): the
        workers begin in its receive; a refusal here tells its senders at once."""
        try:
            if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                raise WeightUpdateError(f"replica {self.replica_id}: version {version!r} must be an int >= 0")
            try:
                check_verify_mode(verify)
                await self._staging.begin(version, verify, staging, layout, plan_id, with_receive=with_receive is not None)
            except ValueError as err:
                raise WeightUpdateError(f"replica {self.replica_id}: {type(err).__name__}: {err}", refusal_of(err)) from None
        except WeightUpdateError as err:
            if with_receive is not None:
                self._receive_reached = True  # (refused here)
                await self._refuse_receive(with_receive, err)
            raise
        if version <= self.version:
            # weightsync restoring the last live version after a torn push (its host copy):
            # the label goes back with the weights, so tokens stay truthfully tagged.
            logger.warning("replica %s: staging version %d while serving %d (restore)", self.replica_id, version, self.version)
        self.update_state, self._staging_version, self._staged_tensors = UpdateState.STAGING, version, 0
        return UpdateAck(replica_id=self.replica_id, version=version)

    async def load_bucket(self, named_tensors: Any, version: int | None = None) -> LoadReport | CommitReport:
        """Stage a payload. A `CollectiveReceive` with `begin` begins the update in the same call
        (and its workers in their receive); one with `commit` then checks the senders' own
        fingerprint and commits, as `commit_update` would (with `begin`: one call for the push)."""
        trace.mark("rep.load")
        async with self._control_lock:
            self._receive_reached = False
            try:
                return await self._load_bucket(named_tensors, version)
            except Exception as err:
                # A collective push's other members wait for this replica (ipc's sender, or everyone at a
                # broadcast's gate) until its workers receive or refuse: a failure before then refuses.
                if isinstance(named_tensors, CollectiveReceive) and not self._receive_reached:
                    await self._refuse_receive(named_tensors, err)
                raise

    async def _refuse_receive(self, payload: CollectiveReceive, err: BaseException) -> None:
        """Tell a collective push's other members that this replica will not take it (best effort,
        bounded: a worker stuck elsewhere must not hold the failure back)."""
        self._groups_joined = None  # refusing may break a worker's group (ipc): ask them next time
        try:
            await asyncio.wait_for(self._staging.refuse(payload, f"replica {self.replica_id}: {err}"), 30.0)
        except Exception as refuse_err:  # noqa: BLE001 - the load's own failure is the one reported
            logger.warning("replica %s: could not refuse the push: %s", self.replica_id, refuse_err)

    async def _load_bucket(self, named_tensors: Any, version: int | None) -> LoadReport | CommitReport:
        """`load_bucket` under the control lock."""
        folded = isinstance(named_tensors, CollectiveReceive) and named_tensors.begin is not None
        if folded:
            await self._begin(named_tensors.version, *named_tensors.begin, with_receive=named_tensors)
        if self.update_state is not UpdateState.STAGING:
            raise WeightUpdateError(f"replica {self.replica_id}: load_bucket without begin_update")
        if version is not None and version != self._staging_version:
            raise WeightUpdateError(f"replica {self.replica_id}: bucket for version {version}, staging {self._staging_version}")
        if is_object_ref(named_tensors):  # a bucket handle that travelled nested, unresolved
            named_tensors = await named_tensors
        commit = isinstance(named_tensors, CollectiveReceive) and named_tensors.commit
        if not commit:
            return LoadReport(replica_id=self.replica_id, staged_tensors=await self._load(named_tensors))
        # A load that commits pauses the engine while it receives: the pause's round trip runs
        # beside the receive's instead of after it, and either order is correct (nothing is
        # applied before both are done). The engine runs no step during the receive anyway: the
        # workers receive inside vLLM's utility call, between steps. Buckets that land one after
        # another (a broadcast) in the engine layout are applied as they land instead, the copy
        # beside the wire: then the pause goes out first (no step may run on them before the check;
        # the receive follows at once when no request is in the engine, else after the pause's reply:
        # `_pause_before_receive`), the ledger's counts are read in the receive before any weight changes, and a check
        # that fails at the end is a failed apply (restored from the last live version, paused). A driver whose
        # workers receive apart from its engine (`receives_apart`: SGLang's replica holds its own) keeps the engine
        # stepping during the receive and pauses it once the receive is done: paused only for the check and the apply.
        pausing, paused_at, overlapped = None, None, False
        apart = self.engine.receives_apart
        early = (named_tensors.stream and self._staging.layout == "engine" and self._staging.staging == "full"
                 and "weights" not in self._asleep and not apart)
        running = self.state is ReplicaState.READY and self._may_run()
        if early:
            # (not running: asleep but for its weights, or paused by a caller: no step can run anyway)
            if running:
                paused_at = time.perf_counter()
                pausing, overlapped = await self._pause_before_receive()
            loads: Any = self._load(named_tensors, early=self._versions.counts_query, applying=True)
        elif running and not apart:
            receiving = asyncio.ensure_future(self._load(named_tensors))
            await asyncio.sleep(0)  # (its call goes out first)
            paused_at = time.perf_counter()
            pausing = asyncio.ensure_future(self._pause_engine("keep"))
            loads = receiving
        else:
            loads = self._load(named_tensors)
        try:
            try:
                staged = await loads
                trace.mark("rep.received")
                if running and apart:  # received apart from the engine, which stepped on: paused for the check
                    paused_at = time.perf_counter()  # and the apply
                    pausing = asyncio.ensure_future(self._pause_engine("keep"))
            finally:
                if pausing is not None:  # paused (or failed to) before anything else happens
                    await asyncio.wait([pausing])
            if pausing is not None:
                await self._paused_for_commit(pausing, applied=overlapped)
                self._paused_mode = "keep"  # held until the apply succeeded
            try:
                fingerprint = self._staging.sender_fingerprint()
            except FingerprintMismatch as err:
                self.counters["updates_failed"] += 1
                applied = self._staging.applied_early is not None
                await self._drop_staged()
                raise WeightUpdateError(f"replica {self.replica_id}: {err}", Refusal.VERIFY_FAILED,
                                        applying=applied) from None
            trace.mark("rep.checked")
            committed = await self._commit(self._staging_version, fingerprint, paused_at=paused_at)
            trace.mark("rep.return")
            return msgspec.structs.replace(committed, fingerprint=fingerprint, staged_tensors=staged)
        except BaseException as err:
            if isinstance(loads, asyncio.Future) and not loads.done():  # this call was cancelled
                loads.cancel()
            if pausing is not None and not getattr(err, "applying", False):  # nothing applied: run again
                await self._undo_pause(pausing)
            raise

    async def _pause_before_receive(self) -> tuple[asyncio.Future, bool]:
        """Pause the engine ahead of a receive that applies as it lands; returns (the pause, whether
        the receive may go out before the pause's reply). With no request in the engine, a pause that
        reached it ahead of the receive (the driver's `pause_ordered` channel) leaves no step between
        them: the receive goes out at once and the pause's round trip runs beside the wire (it is awaited,
        and checked, before anything is committed). A request in flight may be in a step the pause waits
        for, and the ledger's counts must be read after that step: then the receive waits for the pause."""
        pausing = asyncio.ensure_future(self._pause_engine("keep"))
        pausing.add_done_callback(lambda _: trace.mark("rep.paused"))
        await asyncio.sleep(0)  # the pause's first step: its request goes out
        overlapped = self.engine.pause_ordered and not pausing.done() and self.engine.unfinished_requests() == 0
        if not overlapped:
            await asyncio.wait([pausing])
            await self._paused_for_commit(pausing)
        return pausing, overlapped

    async def _paused_for_commit(self, pausing: asyncio.Future, applied: bool = False) -> None:
        """Unless the (finished) `pausing` paused the engine, drop the staged version (it takes no
        apply) and raise; `applied`: the receive beside the pause applied what it received (the error
        then says so: the replica is restored from the last live version)."""
        if pausing.cancelled() or pausing.exception() is not None:
            await self._drop_staged()
            why = pausing.exception() if not pausing.cancelled() else "cancelled"
            if applied:
                self.counters["updates_failed"] += 1
                raise WeightUpdateError(f"replica {self.replica_id}: the engine did not pause for the commit after "
                                        f"the receive applied it (possibly part applied): {why}", applying=True)
            raise WeightUpdateError(f"replica {self.replica_id}: the engine did not pause for the commit: {why}")

    async def _load(self, payload: Any, early: Any = False, applying: bool = False) -> int:
        """Stage `payload` for the version being staged; returns the tensors staged so far.
        `early`: `ReplicaStaging.load`'s (the workers may apply as they receive); `applying`: a
        failure may then have left part of it applied (the replica stays paused for a restore)."""
        self._receive_reached = True  # the workers receive, or refuse, from here on
        try:
            staged = await self._staging.load(payload, self._staging_version, early=early)
        except Exception as err:
            self._groups_joined = None  # a failed receive may have broken a worker's group
            await self._drop_staged()
            # (a push stopped at its gate touched nothing)
            if applying and not is_gate_closed(err):
                self.counters["updates_failed"] += 1
                raise WeightUpdateError(f"replica {self.replica_id}: staging failed while applying as received "
                                        f"(possibly part applied; the replica stays paused until restored): {err}",
                                        applying=True) from err
            raise WeightUpdateError(f"replica {self.replica_id}: staging failed: {err}") from err
        self._staged_tensors = staged
        return staged

    async def _undo_pause(self, pausing: asyncio.Future) -> None:
        """A load that paused for its commit failed before applying anything: the engine runs again."""
        if not pausing.done():
            await asyncio.wait([pausing])
        if pausing.cancelled() or pausing.exception() is not None:
            return  # it never paused
        self._paused_mode = None
        if self.state is ReplicaState.READY and self._may_run():
            try:
                await self._settle()
            except Exception as err:  # the load's own failure is the one reported
                logger.warning("replica %s: resume after a failed load: %s", self.replica_id, err)

    # ---- collective transport groups (weightsync/collective.py) --------------------------------

    async def collective_info(self) -> GroupsReport:
        """How many engine workers this replica has (each is one receiver rank) and which groups
        every one of them still holds."""
        if self._groups_joined is not None:  # asked before every collective push: no round trip to the workers
            return self._groups_joined
        per_worker = await self._rpc(WorkerAPI.asyncrl_collective_groups)
        common = set(per_worker[0]).intersection(*map(set, per_worker[1:])) if per_worker else set()
        return GroupsReport(replica_id=self.replica_id, workers=len(per_worker), groups=sorted(common))

    async def join_collective(self, specs: list[dict[str, Any]], timeout_s: float = 120.0) -> GroupsReport:
        """Join the groups `specs` (every worker, concurrently with the senders)."""
        async with self._control_lock:
            self._groups_joined = None
            joined = await self._rpc(WorkerAPI.asyncrl_join_collective, self.replica_id, list(specs), timeout=timeout_s + 30.0)
            answer = GroupsReport(replica_id=self.replica_id, workers=len(joined), groups=sorted(joined[0]))
            if joined and all(j == joined[0] for j in joined):
                self._groups_joined = answer
            return answer

    async def leave_collective(self) -> GroupsReport:
        """Every worker leaves its broadcast groups: the answer holds none."""
        self._groups_joined = None
        left = await self._rpc(WorkerAPI.asyncrl_leave_collective)
        return GroupsReport(replica_id=self.replica_id, workers=len(left), groups=[])

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport:
        """Check the staged version against `fingerprint` (nothing applied if it differs), then,
        paused, apply it and relabel. A caller that did not pause gets the pause here, and the
        resume after a successful apply; a failed apply leaves the replica paused (weightsync
        restores the last live version, then resumes it)."""
        async with self._control_lock:
            return await self._commit(version, fingerprint)

    async def _commit(self, version: int, fingerprint: str, paused_at: float | None = None) -> CommitReport:
        """`commit_update` under the control lock. `paused_at`: the caller paused the engine for
        this commit (then), and this resumes it after the apply, as for its own pause."""
        if self.update_state is not UpdateState.STAGING or self._staging_version != version:
            raise WeightUpdateError(
                f"replica {self.replica_id}: commit of version {version} but staging {self._staging_version}"
            )
        if "weights" in self._asleep:
            raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} while its weights are "
                                    "asleep (wake_up(['weights']) first); nothing applied")
        try:
            self._staging.check(version, fingerprint)
        except FingerprintMismatch as err:
            self.counters["updates_failed"] += 1
            if self._staging.applied_early is not None:  # it is in the live weights: restore, paused
                await self._drop_staged()
                raise WeightUpdateError(f"replica {self.replica_id}: version {version} was applied as it landed and "
                                        f"its check failed; the replica stays paused until restored: {err}",
                                        Refusal.VERIFY_FAILED, applying=True) from None
            await self._drop_staged()
            raise WeightUpdateError(f"replica {self.replica_id}: commit of version {version} rejected, "
                                    f"staying on {self.version}: {err}", Refusal.VERIFY_FAILED) from None
        self.update_state = UpdateState.COMMITTING
        # The version label may only change while no step runs; pause here if the caller did not.
        paused_here = paused_at is not None or (self.state is ReplicaState.READY and self._may_run())
        t_pause = time.perf_counter() if paused_at is None else paused_at
        if paused_here and paused_at is None:
            await self._pause_engine("keep")
            self._paused_mode = "keep"  # held until the apply succeeded
        t_paused = time.perf_counter()
        try:
            # Paused: no step runs, so the counts the workers read (in the same call as the
            # apply, one round trip) hold until resume.
            applied = await self._staging.apply(version, before=self._versions.counts_query)
            trace.mark("rep.applied")
            sampled = await self._versions.counts(applied.before)
            trace.mark("rep.counted")
        except Exception as err:
            self.counters["updates_failed"] += 1
            raise WeightUpdateError(
                f"replica {self.replica_id}: commit of version {version} failed while applying (possibly part "
                f"applied; the replica stays paused until restored): {err}", applying=True
            ) from err
        finally:
            self.update_state, self._staging_version, self._staged_tensors = UpdateState.IDLE, None, 0
        t_applied = time.perf_counter()
        await self.engine.relabel(version)
        if not paused_here:  # our own pause above cleared the caches, and nothing ran since
            await self.engine.reset_prefix_cache()
        self._versions.mark(version, sampled)  # no await between this and the label change
        self.version = version
        self._weights_discarded = False
        self.counters["updates_committed"] += 1
        # Resume what this commit paused, or start an awake engine whose level-2 sleep had left
        # it without weights until now.
        if paused_here:
            self._paused_mode = None
        t_relabelled = time.perf_counter()
        trace.mark("rep.relabelled")
        if self.state is ReplicaState.READY and paused_here and self._may_run():
            await self._resume_sent()
        elif self.state is ReplicaState.READY and (paused_here or self._may_run()):
            await self._settle()
        end = time.perf_counter()
        apply_s = applied.apply_seconds
        return CommitReport(
            replica_id=self.replica_id, version=self.version, path=applied.path,
            applied_as_received=applied.early,
            # where the paused window goes: the engine's pause, the workers' round trip (the apply
            # inside it), the relabel, the resume
            seconds={"apply": apply_s, "reload": apply_s if applied.path == "reload" else 0.0,
                     "paused": end - t_pause if paused_here else 0.0, "pause_call": t_paused - t_pause,
                     "apply_rpc": t_applied - t_paused, "relabel": t_relabelled - t_applied,
                     "resume_call": end - t_relabelled})

    async def _resume_sent(self) -> None:
        """Resume the engine this commit paused, without waiting for the engine's answer: the call
        is on the wire when this returns, so any later call to the engine (a pause, a request)
        reaches it after the resume. A failure is logged (the engine is gone; its health check
        and the next push say so)."""
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
        await self._staging.abort()
        self.update_state, self._staging_version, self._staged_tensors = UpdateState.IDLE, None, 0

    async def live_fingerprint(self) -> FingerprintReport:
        """The fingerprint of the live parameters, as a full push of them would have."""
        if "weights" in self._asleep:
            raise WeightUpdateError(f"replica {self.replica_id}: weights are asleep, nothing to fingerprint")
        (fp, *_) = await self._rpc(WorkerAPI.asyncrl_fingerprint_params)
        return FingerprintReport(replica_id=self.replica_id, fingerprint=fp)
