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

from asyncrl.generator.replica_types import ReplicaState, UpdateState, WeightUpdateError
from asyncrl.interfaces import WorkerAPI, verb_name
from asyncrl.types import CommitReport, FingerprintReport, GroupsReport, LayoutReport, LoadReport, PlanAck, Refusal, UpdateAck, refusal_of
from asyncrl.weightsync import trace
from asyncrl.weightsync.collective import CollectiveReceive
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

    async def _begin(self, version: int, verify: str, staging: str, layout: str, plan_id: str | None) -> UpdateAck:
        """`begin_update` under the control lock."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightUpdateError(f"replica {self.replica_id}: version {version!r} must be an int >= 0")
        try:
            check_verify_mode(verify)
            await self._staging.begin(version, verify, staging, layout, plan_id)
        except ValueError as err:
            raise WeightUpdateError(f"replica {self.replica_id}: {type(err).__name__}: {err}", refusal_of(err)) from None
        if version <= self.version:
            # weightsync restoring the last live version after a torn push (its host copy):
            # the label goes back with the weights, so tokens stay truthfully tagged.
            logger.warning("replica %s: staging version %d while serving %d (restore)", self.replica_id, version, self.version)
        self.update_state, self._staging_version, self._staged_tensors = UpdateState.STAGING, version, 0
        return UpdateAck(replica_id=self.replica_id, version=version)

    async def load_bucket(self, named_tensors: Any, version: int | None = None) -> LoadReport:
        """Stage a payload (a bucket, its handle, or a `CollectiveReceive`: the workers receive from the senders)."""
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

    async def _load_bucket(self, named_tensors: Any, version: int | None) -> LoadReport:
        """`load_bucket` under the control lock."""
        if self.update_state is not UpdateState.STAGING:
            raise WeightUpdateError(f"replica {self.replica_id}: load_bucket without begin_update")
        if version is not None and version != self._staging_version:
            raise WeightUpdateError(f"replica {self.replica_id}: bucket for version {version}, staging {self._staging_version}")
        if is_object_ref(named_tensors):  # a bucket handle that travelled nested, unresolved
            named_tensors = await named_tensors
        self._receive_reached = True  # the workers receive, or refuse, from here on
        try:
            staged = await self._staging.load(named_tensors, self._staging_version)
        except Exception as err:
            self._groups_joined = None  # a failed receive may have broken a worker's group
            await self._drop_staged()
            raise WeightUpdateError(f"replica {self.replica_id}: staging failed: {err}") from err
        self._staged_tensors = staged
        return LoadReport(replica_id=self.replica_id, staged_tensors=staged)

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

    async def _commit(self, version: int, fingerprint: str) -> CommitReport:
        """`commit_update` under the control lock."""
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
