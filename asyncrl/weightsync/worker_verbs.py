"""The receiving half of a push as the verbs of one worker that holds weights (`WorkerVerbs`), apart from
any engine: vLLM's workers mix it in (vllm_worker.py: `WeightsyncWorkerExtension`, called through
`collective_rpc`), and the SGLang replica holds one in its own process (generator/sglang_engine.py), which
stages and verifies there and hands the tensors to SGLang.

Owns: layout, plan, begin / stage / receive / apply / abort, collective groups, kept buffers.

Must never: import an engine (a vLLM worker never imports SGLang, and the reverse), or change the engine's
weight version label (the replica does, while paused).
"""

from __future__ import annotations

import concurrent.futures
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from asyncrl.types import ApplyReport, Endpoint, LayoutCheck, ReceiveReport
from asyncrl.weightsync import trace
from asyncrl.weightsync.bucket import SharedBucket
from asyncrl.weightsync.receiver import EngineHooks, WorkerReceiver


def _dump(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _settle(future: Any, fn: Callable[..., Any], *args: Any) -> None:
    """`future` gets `fn(*args)`'s result or its exception."""
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 - handed to whoever waits on it
        future.set_exception(err)


class _Runner:
    """A daemon thread kept for one kind of job (a receive apart, its report channel's opening), run as handed
    over: such a job starts without a thread's start, whose handshake waits for the new thread to run (on a busy
    host, milliseconds before the receive's first step). A job handed over while one still runs (a connection still
    being tried) gets a thread of its own."""

    def __init__(self, name: str) -> None:
        self._name, self._jobs = name, queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._busy:
                threading.Thread(target=_settle, args=(future, fn, *args), name=self._name, daemon=True).start()
                return future
            self._busy = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._jobs.put((future, fn, args))
        return future

    def _loop(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            outcome: tuple[bool, Any] = (False, None)
            if future.set_running_or_notify_cancel():
                try:
                    outcome = (True, fn(*args))
                except BaseException as err:  # noqa: BLE001 - handed to whoever waits on it
                    outcome = (False, err)
            with self._lock:  # free before the future is: its waiter may hand over the next job at once
                self._busy = False
            if future.running():
                if outcome[0]:
                    future.set_result(outcome[1])
                else:
                    future.set_exception(outcome[1])


class PauseNotice:
    """The replica's word, for one receive apart from the engine, that the engine paused for its commit (`ok`) or
    could not."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.ok = False

    def set(self, ok: bool) -> None:
        self.ok = bool(ok)
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)


@dataclass
class ApartReceive:
    """What a receive apart from the engine does beyond a plain receive: report the wire's end (`on_wire_end`,
    `lead_s` ahead: `WireEndForecast`), and (`notice`) apply the version itself once its engine paused, reading
    `query` (a worker verb, "" none) first."""

    on_wire_end: Callable[[], None] | None = None
    lead_s: float = 0.0
    notice: PauseNotice | None = None
    query: str = ""


class WireEndForecast:
    """When a receive apart from the engine tells its replica the wire is ending (`on_wire_end`, once): as soon
    as the rest of the version should land within `lead_s` seconds (the replica's engine takes about that long
    to pause, so it is paused by the time the last bucket is in), plus the time to copy what landed by then into
    the live weights at `copy_rate` (a worker that applies once paused), judged from the rate the buckets after
    the first have landed at (at the first, from `wire_rate`, the last push's); else (`fire`) once the last bucket
    is in. Pausing early costs nothing but the engine's idle time."""

    def __init__(self, on_wire_end: Callable[[], None], lead_s: float = 0.0, copy_rate: float = 0.0,
                 wire_rate: float = 0.0) -> None:
        self._on_wire_end: Callable[[], None] | None = on_wire_end
        self.lead_s = max(0.0, float(lead_s))
        self.copy_rate = max(0.0, float(copy_rate))  # bytes/s: what landed is copied live once paused (apply_paused)
        self.wire_rate = max(0.0, float(wire_rate))  # bytes/s the last push's buckets landed at: judged from the first
        self._landed = 0
        self._first: tuple[float, int] | None = None  # (when the first bucket landed, its bytes)
        self._last = 0.0  # when the last bucket so far landed

    def rate(self) -> float:
        """The rate the buckets after the first landed at (bytes/s; 0 before the second)."""
        if self._first is None or self._last <= self._first[0]:
            return 0.0
        return (self._landed - self._first[1]) / (self._last - self._first[0])

    def landed(self, nbytes: int, table: Any) -> None:
        """A bucket of the last group landed; `table` is that group's `WholeTable` (None: sizes unknown)."""
        now = self._last = time.perf_counter()
        self._landed += int(nbytes)
        if self._first is None:
            self._first = (now, int(nbytes))
        if self._on_wire_end is None or self.lead_s <= 0 or table is None or self._landed > int(table.nbytes):
            return  # (more than the table says: a version sent bucket by bucket, the table an earlier push's)
        rate = self.rate() or self.wire_rate  # (at the first bucket: the last push's)
        if rate <= 0:
            return
        remaining = max(0, int(table.nbytes) - self._landed)
        # ... and, where the worker applies what landed once paused, ahead by that copy too (last push's rate)
        lead = self.lead_s + (self._landed / self.copy_rate if self.copy_rate > 0 else 0.0)
        if remaining / rate <= lead:
            trace.mark("wrk.wire_end_forecast")
            self.fire()

    def fire(self) -> None:
        on_wire_end, self._on_wire_end = self._on_wire_end, None
        if on_wire_end is not None:
            on_wire_end()


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

    def asyncrl_receive_collective(self, version: int, group_ids: list[str], timeout_s: float,
                                   begin: tuple | None = None, with_sender: bool = False,
                                   early: str | None = None, gate: str = "") -> ReceiveReport:
        """Stage every bucket of `version` from the groups `group_ids` (in order), each straight
        into this worker's memory; returns the digests staged. `begin` (verify, staging, layout): begin the update
        first, in this call. `with_sender`: also read the senders' digests (the report's `sender`).
        `early` (with `with_sender`; the engine is paused for this commit): on broadcast groups with
        an engine-layout full staging, read `early` (an `asyncrl_` query of this worker, "" none:
        the ledger's counts, as `asyncrl_apply_after` reads them) first, then copy each bucket into
        the live weights as it lands (`WorkerReceiver.apply_as_received`); the report's `applied` is then
        the apply's report and `before` the query's answer, else both None (the commit applies).
        `gate` (broadcast groups): the push's gate token. This worker passes every group's gate once it
        has begun (collective.py), and closes them instead if it cannot take the push."""
        return self._asyncrl_receive(version, group_ids, timeout_s, begin, with_sender, early, gate)

    def _asyncrl_receive(self, version: int, group_ids: list[str], timeout_s: float, begin: tuple | None,
                         with_sender: bool, early: str | None, gate: str, apart: "ApartReceive | None" = None) -> ReceiveReport:
        """`asyncrl_receive_collective`; `apart`: a receive apart from the engine (`ApartReceive`). Traced: where a
        stalled receive waits (trace.py)."""
        with trace.watch():
            return self._asyncrl_receive_watched(version, group_ids, timeout_s, begin, with_sender, early, gate, apart)

    def _asyncrl_apply_paused(self, rx: WorkerReceiver, version: int, query: str) -> tuple[Any, Any]:
        """The engine paused for this receive's commit: read `query` first (the ledger's counts, "" none: nothing
        may change the live weights before), then copy what landed into them, and each later bucket as it lands
        (`WorkerReceiver.apply_staged_now`). (The query's answer, the copy's timing for `_asyncrl_copy_timed`.)"""
        before = self._asyncrl_query(query)() if query else None
        timing = None
        if rx.hooks.device.type == "cuda":  # timed on the device: the receive thread does not wait for the copy
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        nbytes = rx.apply_staged_now(version)
        if nbytes is None:
            return None, None
        if rx.hooks.device.type == "cuda" and nbytes:
            end.record()
            timing = (nbytes, start, end)
        trace.mark("wrk.applied_landed")
        return before, timing

    def _asyncrl_copy_timed(self, timing: Any) -> None:
        """Keep the rate of the copy `_asyncrl_apply_paused` timed (once it is done) for the next forecast."""
        if timing is not None:
            nbytes, start, end = timing
            end.synchronize()
            self.__dict__["_asyncrl_copy_rate"] = nbytes / max(start.elapsed_time(end) / 1e3, 1e-6)

    def _asyncrl_receive_watched(self, version: int, group_ids: list[str], timeout_s: float, begin: tuple | None,
                                 with_sender: bool, early: str | None, gate: str, apart: "ApartReceive | None") -> ReceiveReport:
        from asyncrl.weightsync.collective import CollectiveError
        from asyncrl.weightsync.wire import receive_stream, sender_digests

        trace.mark("wrk.receive")
        groups = self.__dict__.get("_asyncrl_groups", {})
        skipped = set(self._asyncrl_not_member())
        group_ids = [gid for gid in group_ids if gid not in skipped]  # (formed without this worker's rank)
        deadline = time.monotonic() + timeout_s
        rx = self._asyncrl_rx()
        try:
            if begin is not None:
                rx.begin(version, *begin)
            missing = [gid for gid in group_ids if gid not in groups or groups[gid].broken]
            if missing:
                raise CollectiveError(f"worker holds no usable group {missing[0]!r} (has {sorted(groups)})")
        except Exception as err:
            self.asyncrl_refuse_collective(group_ids, f"{type(err).__name__}: {err}", gate)
            raise
        trace.mark("wrk.begun")
        theirs: dict[str, bytes] = {}
        first, applied = None, None
        streamed = all(groups[gid].spec.backend != "ipc" for gid in group_ids)
        if early is not None and with_sender and streamed:
            first = self._asyncrl_query(early)() if early else None  # read before any live weight changes
            if not rx.apply_as_received(version):
                first = None
        gated = bool(gate) and streamed
        forecast = None if apart is None or apart.on_wire_end is None else WireEndForecast(
            apart.on_wire_end, apart.lead_s, self.__dict__.get("_asyncrl_copy_rate", 0.0),
            self.__dict__.get("_asyncrl_wire_rate", 0.0))
        notice = apart.notice if apart is not None and with_sender and streamed else None
        switched, timing = False, None  # (the notice acted on: at most once; its copy's timing)
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
            trace.mark("wrk.streaming")
            last = gid == group_ids[-1]
            for k, (bucket, expected) in enumerate(receive_stream(group, deadline)):
                trace.mark(f"wrk.landed.{k}")
                if forecast is not None and last:
                    forecast.landed(bucket.nbytes, group._whole_table)
                rx.stage(version, bucket, expected, lazy=True, batch=ipc)  # full staging: one wait for every digest, below
                trace.mark(f"wrk.staged.{k}")
                if notice is not None and not switched and notice.is_set() and notice.ok:
                    switched = True  # the engine paused with buckets still to land: what landed goes live now
                    first, timing = self._asyncrl_apply_paused(rx, version, apart.query)  # type: ignore[union-attr]
            trace.mark("wrk.end_header")
            if with_sender:
                theirs.update(sender_digests(group, deadline))
        if forecast is not None:
            forecast.fire()
            rate = forecast.rate()
            if rate > 0:  # (kept for the next receive's first bucket)
                self.__dict__["_asyncrl_wire_rate"] = rate
        digests = rx.digests(version)
        trace.mark("wrk.digests")
        if notice is not None and not switched:  # every bucket is in: the apply waits for the engine's pause
            if not notice.wait(max(0.0, deadline - time.monotonic())) or not notice.ok:
                raise RuntimeError(f"version {version}: the engine did not pause for this receive's commit; "
                                   "nothing was applied")
            first, timing = self._asyncrl_apply_paused(rx, version, apart.query)  # type: ignore[union-attr]
        if rx.applying_as_received:
            applied = rx.finish_received(version)
            self._asyncrl_copy_timed(timing)
        trace.mark("wrk.return")
        return ReceiveReport(digests=digests, sender=theirs, applied=applied, before=first)

    def asyncrl_receive_start(self, version: int, group_ids: list[str], timeout_s: float, begin: tuple | None,
                              with_sender: bool, gate: str, reply: dict[str, Any]) -> None:
        """`asyncrl_receive_collective` (never applying as it lands) in a thread of this worker, so that the engine
        steps on while the push is on the wire; returns at once. Its answer, or its error's text, goes to the
        replica over `reply` ({host, port, token} of the replica's push channel, and `call`, this receive's id):
        `receive_done(call, rank, ok, answer)`; before it, `wire_end(call, rank)` once its last buckets land, or
        (`reply["lead_s"]`: how long the replica's engine takes to pause) that long before they should.
        `reply["apply_paused"]` (with `with_sender`; the replica reaches this worker's channel): the worker applies
        the version itself once the replica says its engine paused (`asyncrl_engine_paused`), what landed at once
        and the rest as it lands, reading `reply["query"]` first; the answer then carries the apply's report, as a
        receive applied as it landed does. One receive at a time: a second before the first ended is refused.
        Reached through vLLM's utility call, or through this worker's own channel (`asyncrl_start_channel`), which
        does not wait for the engine's step."""
        running = self.__dict__.get("_asyncrl_receiving")
        if running is not None and not running.done():
            raise RuntimeError("a receive apart from the engine is still running on this worker")
        rank = int(getattr(self, "rank", 0))
        notice = PauseNotice() if reply.get("apply_paused") and with_sender else None
        self.__dict__["_asyncrl_pause_notice"] = (reply["call"], notice)

        def run() -> None:
            import torch

            from asyncrl.weightsync.push_channel import RECEIVE_DONE, WIRE_END, BlockingChannel, ChannelClosed, call_once

            device = getattr(self, "device", None)
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.set_device(torch.device(device))  # (a new thread starts on device 0, not the worker's)
            address = msgspec.convert(reply["endpoint"], Endpoint)
            # One connection to the replica for both reports, opened in a thread of its own beside the wire (not
            # before it: the receive reaches its gate first); the answer goes on a fresh one if it could not.
            opening = self._asyncrl_runner("asyncrl-report").submit(BlockingChannel, address, timeout_s)

            def wire_end() -> None:  # the replica may pause its engine now, beside the digests' read
                try:
                    opening.result(timeout_s).post(WIRE_END, reply["call"], rank)
                except Exception:  # noqa: BLE001 - the replica then pauses at the receive's end, as before
                    pass

            try:
                answer: Any = (True, self._asyncrl_receive(version, group_ids, timeout_s, begin, with_sender, None, gate,
                                                            ApartReceive(wire_end, float(reply.get("lead_s") or 0.0),
                                                                         notice, str(reply.get("query") or ""))))
            except BaseException as err:  # noqa: BLE001 - reported to the replica, whose load raises it
                answer = (False, f"{type(err).__name__}: {err}")
            try:
                try:
                    with opening.result(timeout_s) as reporting:
                        reporting.call(RECEIVE_DONE, reply["call"], rank, *answer)
                except (ChannelClosed, TimeoutError):  # not opened, or broke (a second report reads as the first)
                    call_once(address, RECEIVE_DONE, reply["call"], rank, *answer, timeout_s=timeout_s)
            except Exception as err:  # noqa: BLE001 - the replica's load then ends at its deadline
                import logging

                logging.getLogger(__name__).warning("worker %d: could not report receive %s to the replica: %s: %s",
                                                    rank, reply["call"], type(err).__name__, err)

        self.__dict__["_asyncrl_receiving"] = self._asyncrl_runner("asyncrl-receive").submit(run)

    def _asyncrl_runner(self, name: str) -> _Runner:
        runners = self.__dict__.setdefault("_asyncrl_runners", {})
        if name not in runners:
            runners[name] = _Runner(name)
        return runners[name]

    def asyncrl_start_channel(self, host: str) -> Endpoint:
        """Where the replica may start this worker's receives apart from the engine (`asyncrl_receive_start`)
        without going through the engine's input queue, which holds a call until the step in flight ends:
        the `Endpoint` of this worker's `ThreadServer` (push_channel.py), started at the first call.
        `host`: the replica's node, which is this worker's unless Ray places it elsewhere."""
        from asyncrl.weightsync.push_channel import ThreadServer, node_host

        server = self.__dict__.get("_asyncrl_channel")
        if server is None:  # (Ray's address for this node where this worker is a Ray process: a multi-node engine)
            server = self.__dict__["_asyncrl_channel"] = ThreadServer(
                self, ["asyncrl_receive_start", "asyncrl_engine_paused"], node_host(host))
        return server.address

    def asyncrl_engine_paused(self, call: str, ok: bool) -> None:
        """The replica's engine paused (`ok`) for the commit of receive `call`, or could not (a receive started with
        `apply_paused` then fails, nothing applied). A word for another receive than the running one is dropped."""
        held = self.__dict__.get("_asyncrl_pause_notice")
        if held is not None and held[0] == call and held[1] is not None:
            held[1].set(ok)

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
