"""The receiving half of a push as the verbs of one worker that holds weights (`WorkerVerbs`), apart from
any engine: vLLM's workers mix it in (vllm_worker.py: `WeightsyncWorkerExtension`, called through
`collective_rpc`), and the SGLang replica holds one in its own process (generator/sglang_engine.py), which
stages and verifies there and hands the tensors to SGLang.

Owns: layout, plan, begin / stage / receive / apply / abort, collective groups, kept buffers.

Must never: import an engine (a vLLM worker never imports SGLang, and the reverse), or change the engine's
weight version label (the replica does, while paused).
"""

from __future__ import annotations

import pickle
import time
from typing import Any

from asyncrl.types import ApplyReport, LayoutCheck, ReceiveReport
from asyncrl.weightsync import trace
from asyncrl.weightsync.bucket import SharedBucket
from asyncrl.weightsync.receiver import EngineHooks, WorkerReceiver


def _dump(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


class WorkerVerbs:
    """The `asyncrl_*` verbs of one worker that holds weights; methods are prefixed `asyncrl_` so they never
    clash with the worker's own. A subclass says where the engine is (`_asyncrl_hooks`) and has `rank`
    (its rank in the engine) and, off the CPU, `device`."""

    # HF buckets from a shared file staged on the worker's device (SGLang takes them over CUDA IPC); vLLM's
    # loaders read them from a private host mapping
    _asyncrl_hf_on_device = False

    def _asyncrl_hooks(self) -> EngineHooks:
        raise NotImplementedError

    def _asyncrl_rx(self) -> WorkerReceiver:
        rx = self.__dict__.get("_asyncrl_receiver")
        if rx is None:
            rx = self.__dict__["_asyncrl_receiver"] = WorkerReceiver(self._asyncrl_hooks())
        return rx

    # ---- layout and plan ------------------------------------------------------------------------
    def asyncrl_check_layout(self) -> LayoutCheck:
        return self._asyncrl_rx().check_layout()

    def asyncrl_layout(self, manifest: bytes) -> bytes:
        """This worker's layout (pickled `EngineLayout`) for the learner's export manifest."""
        return _dump(self._asyncrl_rx().layout_for(pickle.loads(manifest)))

    def asyncrl_set_plan(self, plan: bytes | None) -> str | None:
        """Accept a push plan (pickled `PushPlan`) if this worker's layout is the plan's; returns its id."""
        rx = self._asyncrl_rx()
        rx.set_plan(pickle.loads(plan) if plan is not None else None)
        return rx.plan_id

    # ---- one update -----------------------------------------------------------------------------
    def asyncrl_begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf") -> None:
        trace.mark("wrk.begin")
        self._asyncrl_rx().begin(version, verify, staging, layout)

    def asyncrl_stage_file(self, version: int, wire: tuple, expected: dict[str, bytes] | None = None) -> dict[str, bytes]:
        """Stage one bucket from the replica's shared file; returns its digests."""
        path, metas, rank = wire
        shared = SharedBucket.from_wire(path, metas, rank)
        rx = self._asyncrl_rx()
        from asyncrl.weightsync.receiver import copy_to

        if rank is None:  # HF tensors for the engine's loaders: a private, writable mapping
            bucket = shared.open()
            if self._asyncrl_hf_on_device and rx.hooks.device.type != "cpu":
                bucket = copy_to(bucket, rx.hooks.device)
        else:  # read-only, and the same mapping as the file's last use (the sender reuses its files)
            from asyncrl.weightsync.bucket import SharedMaps

            bucket = self.__dict__.setdefault("_asyncrl_maps", SharedMaps()).open(shared, version)
            if rx.hooks.device.type != "cpu":
                bucket = copy_to(bucket, rx.hooks.device)  # staged where the parameters live
        return rx.stage(version, bucket, expected)

    def asyncrl_receive_collective(self, version: int, group_ids: list[str], timeout_s: float, gate: str = "") -> ReceiveReport:
        """Stage every bucket of `version` from the groups `group_ids` (in order), each straight into this worker's
        memory; returns the digests staged. `gate` (broadcast groups): the push's gate token. This worker passes
        every group's gate (collective.py), and closes them instead if it cannot take the push. Traced: where a
        stalled receive waits (trace.py)."""
        with trace.watch():
            return self._asyncrl_receive(version, group_ids, timeout_s, gate)

    def _asyncrl_receive(self, version: int, group_ids: list[str], timeout_s: float, gate: str) -> ReceiveReport:
        from asyncrl.weightsync.collective import CollectiveError
        from asyncrl.weightsync.wire import receive_stream

        trace.mark("wrk.receive")
        groups = self.__dict__.get("_asyncrl_groups", {})
        skipped = set(self._asyncrl_not_member())
        group_ids = [gid for gid in group_ids if gid not in skipped]  # (formed without this worker's rank)
        deadline = time.monotonic() + timeout_s
        rx = self._asyncrl_rx()
        missing = [gid for gid in group_ids if gid not in groups or groups[gid].broken]
        if missing:
            err = CollectiveError(f"worker holds no usable group {missing[0]!r} (has {sorted(groups)})")
            self.asyncrl_refuse_collective(group_ids, f"{type(err).__name__}: {err}", gate)
            raise err
        gated = bool(gate) and all(groups[gid].spec.backend != "ipc" for gid in group_ids)
        if gated:  # ready on every group at once; each group's decision is awaited when its turn comes (a
            for gid in group_ids:  # later PP stage may only start sending once an earlier one is done)
                groups[gid].arrive(gate)
            trace.mark("wrk.arrived")
        for gid in group_ids:
            group = groups[gid]
            if gated:
                group.await_gate(gate, deadline)
                trace.mark("wrk.gate_open")
            ipc = group.spec.backend == "ipc"  # buckets that arrive at once, mapped: hashed in one pass at the end
            for k, (bucket, expected) in enumerate(receive_stream(group, deadline)):
                trace.mark(f"wrk.landed.{k}")
                rx.stage(version, bucket, expected, lazy=True, batch=ipc)  # full staging: one wait for every digest, below
            trace.mark("wrk.end_header")
        digests = rx.digests(version)
        trace.mark("wrk.return")
        return ReceiveReport(digests=digests)

    def asyncrl_refuse_collective(self, group_ids: list[str], why: str, gate: str = "") -> None:
        """Refuse the coming push on the groups `group_ids` (its begin failed): its sender (ipc), or
        every member at its gate `gate` (gloo / NCCL), stops at once. Best effort on each group."""
        from asyncrl.weightsync.wire import refuse_push

        for gid in group_ids:
            group = self.__dict__.get("_asyncrl_groups", {}).get(gid)
            if group is not None and not group.broken:
                try:
                    refuse_push(group, why, gate)
                except Exception:  # noqa: BLE001 - a group whose store is gone has nobody waiting
                    pass

    def asyncrl_apply(self, version: int) -> ApplyReport:
        return self._asyncrl_rx().apply(version)

    def _asyncrl_query(self, name: str) -> Any:
        """This worker's `asyncrl_` query `name`, to run before an apply (never an apply itself)."""
        if not name.startswith("asyncrl_") or name.startswith("asyncrl_apply"):
            raise ValueError(f"{name!r} is not a worker query to run before an apply")
        return getattr(self, name)

    def asyncrl_apply_after(self, version: int, before: str) -> tuple[Any, ApplyReport]:
        """`before` (an `asyncrl_` method of this worker, no arguments), then the apply: one round trip."""
        first = self._asyncrl_query(before)()
        return first, self._asyncrl_rx().apply(version)

    def asyncrl_abort_update(self) -> None:
        self._asyncrl_rx().abort()

    # ---- collective groups (weightsync/collective.py) ---------------------------------------------
    def asyncrl_join_collective(self, replica_id: str, specs: list[dict[str, Any]]) -> list[str]:
        """Leave any earlier groups, then join each group in `specs` (one per sending learner
        rank, in sender order) that takes this worker's engine rank (`GroupSpec.takes`: a shard
        plan's sender feeds only some), as its receiver rank. Returns the ids of every group in
        `specs` (the same on every worker: those it is not a member of it is done with)."""
        from asyncrl.weightsync.collective import CollectiveGroup, GroupSpec

        self.asyncrl_leave_collective()
        groups: dict[str, Any] = {}
        parsed = [GroupSpec(**raw) for raw in specs]
        mine = int(self.rank)  # type: ignore[attr-defined]
        try:
            for spec in parsed:
                if spec.takes(mine):
                    rank = spec.receiver_rank(replica_id, mine)
                    groups[spec.group_id] = CollectiveGroup.join(spec, rank, getattr(self, "device", None))
        except BaseException:
            for group in groups.values():
                group.close()
            raise
        self.__dict__["_asyncrl_groups"] = groups
        self.__dict__["_asyncrl_group_order"] = [s.group_id for s in parsed]  # (those not in `groups`: formed without it)
        return [s.group_id for s in parsed]

    def _asyncrl_not_member(self) -> list[str]:
        """The groups formed without this worker's engine rank (`GroupSpec.takes`), in sender order."""
        groups = self.__dict__.get("_asyncrl_groups", {})
        return [gid for gid in self.__dict__.get("_asyncrl_group_order", []) if gid not in groups]

    def asyncrl_leave_collective(self) -> None:
        self.__dict__.pop("_asyncrl_group_order", None)
        for group in self.__dict__.pop("_asyncrl_groups", {}).values():
            group.close()
        self._asyncrl_rx().release_views()  # (views of the groups' buffers, kept for their next push)

    def asyncrl_release_buffers(self) -> None:
        """Drop what this worker keeps from one push to the next in device memory: each group's receive
        buffers and the receiver's views of them (the next push allocates them again). The replica calls it
        before the engine sleeps, so that sleeping releases that memory too."""
        for group in self.__dict__.get("_asyncrl_groups", {}).values():
            group.release_kept()
        self._asyncrl_rx().release_views()

    def asyncrl_collective_groups(self) -> list[str]:
        """Ids of the groups this worker is ready for: those it holds that can still carry a push, and
        those formed without it (`GroupSpec.takes`)."""
        held = [gid for gid, g in self.__dict__.get("_asyncrl_groups", {}).items() if not g.broken]
        return held + self._asyncrl_not_member()
