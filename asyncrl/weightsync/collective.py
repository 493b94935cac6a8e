"""Collective transports: buckets from the sending learner ranks straight into the engine workers' memory.

Owns: `GroupSpec` (one group per sending rank, group rank 0, every engine worker a receiver), the sending rank's
rendezvous port (`reserve_port`), `CollectiveGroup` (join, broadcast with a deadline, close) and the wire's header
kinds, over NCCL on GPUs (vLLM's PyNcclCommunicator) or gloo on CPUs (ipc needs no group). One push's loops are
stream.py's. The gate: no member touches the wire for a push until every member is ready for it; one that cannot
take it closes the gate and all leave without a byte sent, the group usable (`GateClosed`). A joining member loads
every kernel a push launches (`warm_push_kernels`; in a push a first launch waits for the queued broadcasts).
Must never: block without a deadline (a broken group is formed again by the next push), use the default
torch.distributed group, decide when a push happens or what is live (push.py), or apply anything to live weights.
Details: docs/design/weightsync.md.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.weightsync.bucket import Bucket, pack_bucket
from asyncrl.weightsync.fingerprint import buckets_digests_lazy
from asyncrl.weightsync.transport import HostCopies

# Header kinds (first int64 of a header): the sender is done, the sender failed, and the push's one table of every
# bucket (gloo / nccl: then every bucket and an END / ABORT header, as one receive).
END, ABORT, WHOLE = 2, 3, 4
GATE_OPEN = "open"  # a gate's decision once every member arrived (else "closed: <why>")


class CollectiveError(RuntimeError):
    """A collective step failed or timed out; the group it ran on is closed."""


class SenderAborted(CollectiveError):
    """The sender told the receivers it could not finish this push (its export failed)."""


class GateClosed(SenderAborted):
    """The push was stopped at its gate, before any byte went out: a member refused it, the publisher
    stopped it, or a member never came by the deadline. The group stays usable."""


def gate_keys(group_id: str, token: str) -> tuple[str, str, str]:
    """The store keys of one push's gate on a group: the members' count, the decision, and the key its
    waiters wait on (set after every decision: the store's non-libuv server, which a sender's
    pre-bound port uses, wakes no waiter when `compare_set` writes a key)."""
    base = f"asyncrl-gate/{group_id}/{token}"
    return f"{base}/n", f"{base}/go", f"{base}/decided"


def decide_gate(store: Any, group_id: str, token: str, decision: str) -> str:
    """Write the `decision` (GATE_OPEN, or "closed: <why>") of push `token`'s gate on group `group_id` unless it is
    decided already, and wake its waiters; returns the decision that stands. `store`: a client of the group's store."""
    _, go, decided = gate_keys(group_id, token)
    out = store.compare_set(go, "", decision[:2000]).decode(errors="replace")
    store.set(decided, "1")
    return out


@dataclass(frozen=True)
class GroupSpec:
    """One broadcast group: the sending learner rank (group rank 0, hosts the rendezvous) and every engine worker
    of the replicas in `receivers` (replica id -> its workers' first group rank; a worker adds its engine rank)."""

    group_id: str
    backend: str
    host: str
    port: int
    world_size: int
    receivers: dict[str, int]
    sender: int = 0  # which sending rank (PP stage order) this group belongs to
    timeout_s: float = 120.0

    def receiver_rank(self, replica_id: str, worker_rank: int) -> int:
        if replica_id not in self.receivers:
            raise CollectiveError(f"group {self.group_id} was formed without replica {replica_id!r}")
        rank = self.receivers[replica_id] + worker_rank
        if not 0 < rank < self.world_size:
            raise CollectiveError(f"group {self.group_id}: replica {replica_id!r} worker {worker_rank} -> rank {rank}, "
                                  f"outside 1..{self.world_size - 1}")
        return rank


@dataclass(frozen=True)
class CollectiveReceive:
    """The `load_bucket` payload of a collective push: receive every bucket of `version` from
    the groups `group_ids` (in sender order) until each sender says it is done."""

    group_ids: tuple[str, ...]
    version: int
    timeout_s: float = 120.0
    gate: str = ""  # the push's gate token: every member waits at it before the wire


def free_port(host: str = "") -> int:
    """A port free a moment ago (tests: another process may take it before it is bound; senders `reserve_port`)."""
    with reserve_port(host) as s:
        return int(s.getsockname()[1])


def reserve_port(host: str) -> socket.socket:
    """A listening socket on an OS-chosen port of `host`, held until the group's store takes it over
    (`CollectiveGroup.join(..., listen_socket=)`), so no other process takes the port before the group forms."""
    return socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


def join_as_sender(spec: GroupSpec, reserved: socket.socket | None,
                   device: torch.device | str | None = None) -> "CollectiveGroup":
    """Join `spec` as group rank 0, serving the store on `reserved` (`reserve_port`) if it listens on the spec's port
    (one on another port, an older address, is dropped); a socket the store did not take over is always closed."""
    on_port = reserved is not None and reserved.getsockname()[1] == spec.port
    try:
        return CollectiveGroup.join(spec, 0, device, listen_socket=reserved if on_port else None)
    finally:
        if reserved is not None:
            reserved.close()  # (no-op once the store detached it)


def _tcp_store(spec: GroupSpec, rank: int, timeout: datetime.timedelta, listen_socket: socket.socket | None) -> Any:
    """The group's TCPStore: rank 0 serves it (on `listen_socket` when given), the others connect."""
    kwargs: dict[str, Any] = {"world_size": spec.world_size, "is_master": rank == 0, "timeout": timeout,
                              "wait_for_workers": False}
    if listen_socket is None or rank != 0:
        return dist.TCPStore(spec.host, spec.port, **kwargs)
    fd = listen_socket.detach()
    try:  # the libuv server does not take a listening fd
        return dist.TCPStore(spec.host, spec.port, master_listen_fd=fd, use_libuv=False, **kwargs)
    except Exception:
        socket.close(fd)
        raise


def form_specs(backend: str, senders: list[tuple[str, int]], replica_workers: dict[str, int], *,
               timeout_s: float, group_prefix: str) -> list[GroupSpec]:
    """One spec per sending rank (its rendezvous `(host, port)`, in sender order); replicas get rank blocks in id
    order, so every member computes the same layout."""
    if not senders:
        raise CollectiveError("no sending learner rank to form a weight broadcast group with")
    if not replica_workers:
        raise CollectiveError("no engine replica to form a weight broadcast group with")
    receivers, nxt = {}, 1
    for rid in sorted(replica_workers):
        receivers[rid], nxt = nxt, nxt + replica_workers[rid]
    return [GroupSpec(f"{group_prefix}-s{i}", backend, host, port, nxt, dict(receivers), i, timeout_s)
            for i, (host, port) in enumerate(senders)]


# ---- kernel warm-up: a push's kernels loaded when a member joins, before any broadcast is queued on its device ----

WARM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_WARM_LOCK = threading.Lock()
_WARMED: set[str] = set()  # the devices this process warmed


def warm_push_kernels(device: torch.device | str | None) -> None:
    """Launch once, on scratch tensors of `device`, every kernel a push launches there, then wait for them (nothing
    off CUDA, whose kernels need no loading, or on a device this process warmed already). Details:
    docs/design/weightsync.md, "Kernel warmup"."""
    dev = member_device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return
    with _WARM_LOCK:
        if str(dev) in _WARMED:
            return
        _warm(dev)
        torch.cuda.synchronize(dev)
        _WARMED.add(str(dev))


def _warm(dev: torch.device) -> None:
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # (the host: the same calls, for tests)
        # a few small tensors of each dtype, sized so that a bucket of them has a short last word
        named = [(f"warm.{str(t).removeprefix('torch.')}.{n}", torch.ones(n, dtype=t, device=dev))
                 for t in WARM_DTYPES for n in (3, 67)]
        bucket = pack_bucket(named, dev)  # the packer's byte copies
        # the same bytes 8 bytes into a larger buffer: Triton compiles a kernel per 16-byte alignment of its pointers
        shifted = torch.zeros(bucket.nbytes + 64, dtype=torch.uint8, device=dev)
        shifted[8 : 8 + bucket.nbytes].copy_(bucket.buffer)
        moved = Bucket(buffer=shifted.narrow(0, 8, bucket.nbytes), metas=bucket.metas)
        for mode in ("checksum", "full"):
            for b in (bucket, moved):
                buckets_digests_lazy([(b, "")], mode)()  # type: ignore[arg-type]
            # a whole version's one pass over buckets that share a storage (sender and receiver alike)
            parts = [Bucket(buffer=shifted.narrow(0, 0, 64), metas=[]), moved]
            buckets_digests_lazy([(b, f"r{i}/") for i, b in enumerate(parts)], mode)()  # type: ignore[arg-type]
        for dtype in WARM_DTYPES:  # the apply's fused copies into live weights, the export's cat and slices
            src = [torch.ones(n, dtype=dtype, device=dev) for n in (5, 129)]
            dst = [torch.empty_like(t) for t in src]
            torch._foreach_copy_(dst, src)
            torch.cat(src).narrow(0, 1, 64).contiguous()
        words = torch.zeros(16, dtype=torch.int64, device=dev)  # the checksums' and the headers' int64 work
        torch.cat([words, words]).fill_(0)


def member_device(device: torch.device | str | None) -> torch.device:
    """`device` with a CUDA index resolved; without one, this process's current CUDA device (else CPU)."""
    dev = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


@dataclass
class CollectiveGroup:
    """One member's end of a `GroupSpec` group. Created with `join`; every member must join at
    about the same time (the rendezvous waits up to the spec's timeout)."""

    spec: GroupSpec
    rank: int
    device: torch.device
    _pg: Any = None  # gloo: ProcessGroupGloo
    _comm: Any = None  # nccl: PyNcclCommunicator
    _stream: Any = None
    broken: bool = False
    _store: Any = field(default=None, repr=False)  # the rendezvous TCPStore (the gate's)
    _copies: HostCopies | None = field(default=None, repr=False)  # sender: the last push's host copies
    _ring_sender: bool = False  # gloo / nccl sender: its device could not hold a whole version (bucket.py's SenderRing)
    _gate_keys: list = field(default_factory=list, repr=False)  # sender: the gate keys of every push not dropped yet

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, device: torch.device | str | None = None, *,
             listen_socket: socket.socket | None = None) -> "CollectiveGroup":
        """Join as `rank`; rank 0 serves the rendezvous store, on `listen_socket` (on the spec's port) when given."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if spec.backend == "gloo":
            store = _tcp_store(spec, rank, timeout, listen_socket)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(spec.group_id + "/", store), rank, spec.world_size, timeout)
            return cls(spec, rank, torch.device("cpu"), _pg=pg, _store=store)
        if not torch.cuda.is_available():
            raise CollectiveError(f"group {spec.group_id}: backend nccl needs CUDA on every member (this one has none)")
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        dev = member_device(device)
        with torch.cuda.device(dev):
            pg = StatelessProcessGroup.create(spec.host, spec.port, rank, spec.world_size,
                                              store_timeout=int(spec.timeout_s),
                                              listen_socket=listen_socket if rank == 0 else None)
            comm = PyNcclCommunicator(pg, device=dev)
            if getattr(comm, "disabled", False):
                raise CollectiveError(f"group {spec.group_id}: vLLM's PyNccl is disabled here (VLLM_DISABLE_PYNCCL?)")
            stream = torch.cuda.Stream(device=dev)
        warm_push_kernels(dev)  # before any broadcast is queued on it
        return cls(spec, rank, dev, _comm=comm, _stream=stream, _store=pg.store)

    def _kv(self) -> Any:
        if self._store is None:
            raise CollectiveError(f"group {self.spec.group_id} is closed")
        return self._store

    def arrive(self, token: str) -> None:
        """This member is ready for push `token`; the member that completes the count opens the gate."""
        keys = gate_keys(self.spec.group_id, token)
        kv = self._kv()
        if self.rank == 0:  # every member is past the last push's keys: dropped while this push's wire runs, not here
            self._gate_keys += keys
        try:
            if kv.add(keys[0], 1) >= self.spec.world_size:
                decide_gate(kv, self.spec.group_id, token, GATE_OPEN)
        except Exception as err:  # the store's owner (the sending rank) is gone
            raise self._failed([], err) from err

    def drop_stale_gate_keys(self) -> None:
        """The sender drops the gate keys of its earlier pushes from the store (housekeeping: nobody reads them)."""
        keys, self._gate_keys = self._gate_keys[:-3], self._gate_keys[-3:]  # (the last push's three are in use)
        for key in keys if self._store is not None else ():
            with contextlib.suppress(Exception):  # housekeeping only
                self._store.delete_key(key)

    def await_gate(self, token: str, deadline: float) -> None:
        """Return once push `token`'s gate is open (every member arrived); raise `GateClosed` if it was closed, or
        close it at `deadline` (a member never came). Nothing touches the wire either way."""
        _, go, decided = gate_keys(self.spec.group_id, token)
        kv = self._kv()
        try:
            try:
                kv.wait([decided], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                decision = kv.get(go).decode(errors="replace")
            except Exception as err:  # the deadline (DistStoreError), or the store's owner is gone
                if time.monotonic() < deadline:
                    raise
                decision = decide_gate(kv, self.spec.group_id, token, f"closed: rank {self.rank} waited to the "
                                       f"deadline for every member ({type(err).__name__})")
        except Exception as err:
            raise self._failed([], err) from err
        if decision != GATE_OPEN:
            raise GateClosed(f"group {self.spec.group_id}: push {token} stopped at its gate before it began ({decision})")

    def close_gate(self, token: str, why: str) -> str:
        """Close push `token`'s gate from this member (it will not take the push); the decision."""
        return decide_gate(self._kv(), self.spec.group_id, token, f"closed: rank {self.rank}: {why}")

    def broadcast_all(self, tensors: list[torch.Tensor], deadline: float) -> None:
        """Broadcast each of `tensors` from the sender into every member's (same shape and dtype, on this member's
        device) and return once all are complete here, by `deadline` (time.monotonic()): past it, CollectiveError."""
        self.enqueue_broadcasts(tensors, deadline).wait()

    def enqueue_broadcasts(self, tensors: list[torch.Tensor], deadline: float, *, events: bool = False) -> "Broadcasts":
        """`broadcast_all` without its wait: enqueued (NCCL: behind what this member's current stream enqueued so
        far), `wait()` on the result waits for them by `deadline`, and work enqueued in between overlaps the wire.
        `events` (NCCL): one CUDA event per tensor, for `ready(i)`, which the host polls: a stream made to wait on one
        would stall the engine's stream for good if the sender died mid-broadcast."""
        if self.broken:
            raise CollectiveError(f"group {self.spec.group_id} is broken (an earlier step failed); form a new one")
        try:
            if self._pg is not None:
                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                return Broadcasts(self, tensors, deadline, works=[self._pg.broadcast([t], opts) for t in tensors])
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            marks = []
            for t in tensors:
                self._comm.broadcast(t, src=0, stream=self._stream)
                t.record_stream(self._stream)
                if events:
                    marks.append(self._stream.record_event())
            return Broadcasts(self, tensors, deadline, done=self._stream.record_event(), events=marks)
        except Exception as err:
            raise self._failed(tensors, err) from err

    def _failed(self, tensors: list[torch.Tensor], err: BaseException) -> "CollectiveError":
        self.close()
        if not tensors:
            return CollectiveError(f"group {self.spec.group_id} rank {self.rank}: {type(err).__name__}: {err}")
        what = (f"{tensors[0].numel()} {str(tensors[0].dtype).removeprefix('torch.')}" if len(tensors) == 1
                else f"{len(tensors)} buckets ({sum(t.numel() for t in tensors)} elements)")
        return CollectiveError(f"group {self.spec.group_id} rank {self.rank}: broadcast of {what} failed: "
                               f"{type(err).__name__}: {err}")

    def close(self) -> None:
        comm, self._comm, self._pg, self._store = self._comm, None, None, None
        self.broken = True
        if comm is not None:
            with contextlib.suppress(Exception):  # best effort: the process may be tearing down
                comm.destroy()


SPIN_S = 0.0005  # a host waiting for a CUDA event polls without sleeping this long first


def _poll(event: Any, deadline: float, what: str) -> None:
    """Return once `event` completed, by `deadline` (time.monotonic()). The first `SPIN_S` poll without sleeping: a
    push's headers, its table and a bucket about to land complete within it, where each sleep's granularity adds up."""
    spin_until = time.perf_counter() + SPIN_S
    while not event.query():
        if time.perf_counter() < spin_until:
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not complete by the deadline")
        time.sleep(0.0001)


@dataclass
class Broadcasts:
    """Broadcasts enqueued on a group (`CollectiveGroup.enqueue_broadcasts`); `wait()` returns
    once they are complete here, or breaks the group and raises CollectiveError at the deadline."""

    group: CollectiveGroup
    tensors: list[torch.Tensor]
    deadline: float
    works: list[Any] = field(default_factory=list)  # gloo
    done: Any = None  # nccl: the event after the last broadcast
    events: list[Any] = field(default_factory=list)  # nccl, on request: one per tensor

    def ready(self, i: int) -> None:
        """Wait (by the deadline) until tensor `i` is complete here: gloo waits for its broadcast, NCCL polls its
        event (`events=True`). Work enqueued after this overlaps the broadcasts still running."""
        try:
            if self.works:
                self.works[i].wait(datetime.timedelta(seconds=max(0.001, self.deadline - time.monotonic())))
                return
            _poll(self.events[i], self.deadline, f"NCCL broadcast of tensor {i}")
        except Exception as err:
            raise self.group._failed(self.tensors, err) from err

    def wait(self) -> None:
        try:
            for work in self.works:
                work.wait(datetime.timedelta(seconds=max(0.001, self.deadline - time.monotonic())))
            if self.done is not None:
                _poll(self.done, self.deadline, "NCCL broadcast")
        except Exception as err:
            raise self.group._failed(self.tensors, err) from err
