"""Collective transports: buckets go from the sending learner ranks straight into the engine
workers' memory, over NCCL on GPUs (vLLM's `PyNcclCommunicator` on a `StatelessProcessGroup`) or
gloo on CPU hosts (torch's `ProcessGroupGloo` on its own TCPStore), the same code either way; or,
with `ipc`, as handles to the sender's own buffer when sender and receivers share a device.

`ipc` (co-located placement): no bytes travel over a wire. The sender packs a bucket on its
device and publishes a handle to it in the group's TCPStore: a CUDA IPC handle (torch's
`reduce_tensor`, keyed by the GPU's UUID so a receiver with another CUDA_VISIBLE_DEVICES order
opens the same physical GPU) for a GPU bucket, a shared-memory file for a CPU bucket. Each
receiver opens it, copies the bucket into its own memory (device to device), and acknowledges
it in the store; the sender frees a bucket once every receiver acknowledged it and keeps at most
`ipc_window` buckets published, so its extra memory stays about that many buckets. With
`ipc_window` 0 (weightsync.staging full) the sender packs the whole version into buffers it keeps
until its next push and publishes it at once; the receivers stage views of those buffers (no copy
of their own) and the commit copies from them into the live parameters. A receiver that fails
records why in the store and the sender stops at once instead of waiting out its deadline.

Owns: the group description (`GroupSpec`: one group per sending rank, that rank is group rank 0 and
every engine worker of every replica a receiver), the sending rank's rendezvous port
(`reserve_port`: held as a listening socket until the group's store serves on it), `CollectiveGroup`
(join, broadcast with a deadline, close), the wire protocol of one push on a group (per bucket: a 3
x int64 header, the tensor table as JSON bytes, the bucket buffer; then an end or abort header; with
`ipc_window` 0, one header and one table for the whole version, then every bucket back to back),
`send_stream` (the sender's loop: pack on the tensors' device, broadcast, hash in the verify mode,
start the host copy (hostcopy.py: made off the critical path, collected by the publisher while
replicas commit)) and `receive_stream` (the receiver's loop: allocate on its device, receive, hand
each bucket on).

gloo / NCCL with `ipc_window` 0 (weightsync.staging full, the receivers stage the whole version
anyway): the sender packs every bucket, enqueues every digest and waits for the device once, sends
one table of every bucket (with its digests), then broadcasts the buckets back to back without a
wait between them, and waits once at the end; each receiver receives them into one allocation.
Per bucket that saves the header and table round trips, the hash's wait and the broadcast's.

Memory: the sender holds one packed bucket on its device at a time (`ipc_window` 0: every bucket
of its version until the broadcast ends), plus up to four sent ones whose host copies are still running, and (on a GPU) a pinned host copy of what it sends, reused
by each push. Each engine worker stages the complete new version (full HF tensors, not its TP
shard) in its device memory until commit, because the commit is atomic: a worker needs headroom for one
unsharded copy of the model beside its live shard. Where that does not fit, use shm (one node:
staged in shared host pages, one copy per node) or object_store.

Neither side ever blocks without a deadline: a gloo wait takes a timeout, a NCCL broadcast runs
on a side stream whose completion event is polled until the deadline. A timed-out group is
broken (its collective state is unknown): it is closed and the next push forms a new one.

Must never: use the default torch.distributed group (the learner's Megatron groups and the
engine's own TP group live there), decide when a push happens or what is live (push.py), or
apply anything to live weights (the worker stages; commit applies).
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.weightsync.bucket import Bucket, TensorMeta, iter_buckets
from asyncrl.weightsync.hostcopy import HostCopies, PinnedPool

BACKENDS = ("gloo", "nccl", "ipc")
IPC_WINDOW = 2  # ipc: buckets a sender keeps published (and unacknowledged) before waiting; 0: the whole version
# Header kinds (first int64 of a header): a bucket follows, the sender is done, the sender failed.
BUCKET, END, ABORT = _BUCKET, _END, _ABORT = 1, 2, 3
WHOLE = 4  # ipc_window 0: one record (ipc) or one table (gloo / nccl) holds every bucket of the push


class CollectiveError(RuntimeError):
    """A collective step failed or timed out; the group it ran on is closed."""


class SenderAborted(CollectiveError):
    """The sender told the receivers it could not finish this push (its export failed)."""


@dataclass(frozen=True)
class GroupSpec:
    """One broadcast group: the sending learner rank (group rank 0, hosts the rendezvous) and
    every engine worker of the replicas named in `receivers` (replica id -> its workers' first
    group rank; a worker adds its rank inside the engine)."""

    group_id: str
    backend: str
    host: str
    port: int
    world_size: int
    receivers: dict[str, int]
    sender: int = 0  # which sending rank (PP stage order) this group belongs to
    timeout_s: float = 120.0
    ipc_window: int = IPC_WINDOW  # ipc: buckets published at once; 0 (any backend): the whole version at once

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got {self.backend!r}")
        if isinstance(self.ipc_window, bool) or not isinstance(self.ipc_window, int) or self.ipc_window < 0:
            raise ValueError(f"group {self.group_id}: ipc_window must be an int >= 0, got {self.ipc_window!r}")
        if self.world_size < 2:
            raise ValueError(f"group {self.group_id}: world_size {self.world_size} leaves nobody to send to")

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


def free_port(host: str = "") -> int:
    """A port that was free a moment ago (tests only: another process may take it before it is
    bound again; a sending rank holds its port with `reserve_port`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_port(host: str) -> socket.socket:
    """A listening socket on an OS-chosen port of `host`, held until the group's store takes it
    over (`CollectiveGroup.join(..., listen_socket=)`), so no other process can take the port
    between the rendezvous address going out and the group forming."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


def join_as_sender(spec: GroupSpec, reserved: socket.socket | None,
                   device: torch.device | str | None = None) -> "CollectiveGroup":
    """Join `spec` as its sending rank (group rank 0), serving the store on `reserved` (from
    `reserve_port`) when that listens on the spec's port; one on another port (an older address)
    is dropped. A socket the store did not take over is closed, whatever happens."""
    if reserved is not None and reserved.getsockname()[1] != spec.port:
        reserved.close()
        reserved = None
    try:
        return CollectiveGroup.join(spec, 0, device, listen_socket=reserved)
    finally:
        if reserved is not None and reserved.fileno() != -1:
            reserved.close()


def _tcp_store(spec: GroupSpec, rank: int, timeout: datetime.timedelta, listen_socket: socket.socket | None) -> Any:
    """The group's TCPStore: rank 0 serves it (on `listen_socket` when given), the others connect."""
    import torch.distributed as dist

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


def ipc_window_for(staging: str) -> int:
    """The window for a staging mode: full staging sends the whole version at once (ipc: kept in
    the sender's buffers, the receivers' staging area; gloo / NCCL: one table, then every bucket
    back to back), bucketed staging `IPC_WINDOW` buckets at a time (gloo / NCCL: one)."""
    return 0 if staging == "full" else IPC_WINDOW


def form_specs(backend: str, senders: list[tuple[str, int]], replica_workers: dict[str, int], *,
               timeout_s: float, group_prefix: str, ipc_window: int = IPC_WINDOW) -> list[GroupSpec]:
    """One spec per sending rank (its rendezvous `(host, port)`, in PP stage order); replicas get
    rank blocks in id order, so every member computes the same layout."""
    if not senders:
        raise CollectiveError("no sending learner rank to form a weight broadcast group with")
    if not replica_workers:
        raise CollectiveError("no engine replica to form a weight broadcast group with")
    receivers, nxt = {}, 1
    for rid in sorted(replica_workers):
        if replica_workers[rid] < 1:
            raise CollectiveError(f"replica {rid!r} reports {replica_workers[rid]} workers")
        receivers[rid], nxt = nxt, nxt + replica_workers[rid]
    return [GroupSpec(f"{group_prefix}-s{i}", backend, host, port, nxt, dict(receivers), i, timeout_s, ipc_window)
            for i, (host, port) in enumerate(senders)]


def _member_device(device: torch.device | str | None) -> torch.device:
    """`device` with a CUDA index resolved; without one, this process's current CUDA device (CPU
    when it has none)."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
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
    _store: Any = field(default=None, repr=False)
    _pushes: int = 0  # ipc: pushes started on this group (both ends count alike; keys carry it)
    _leftover: list[str] = field(default_factory=list)  # ipc sender: the last push's keys, dropped at the next
    _copies: HostCopies | None = field(default=None, repr=False)  # sender: the last push's host copies
    _pinned: PinnedPool | None = field(default=None, repr=False)  # sender on a GPU: their pinned buffers
    _ring: Any = field(default=None, repr=False)  # ipc sender: the buffers it packs into, reused by every push
    _ring_copies: list = field(default_factory=list, repr=False)  # ipc_window 0: the host copies still reading them
    _opened: dict = field(default_factory=dict, repr=False)  # ipc receiver: the sender's buffers, opened once

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, device: torch.device | str | None = None, *,
             listen_socket: socket.socket | None = None) -> "CollectiveGroup":
        """Join as `rank`. Rank 0 serves the rendezvous store, on `listen_socket` (from
        `reserve_port`, bound to spec.port; the store takes it over) when given."""
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if listen_socket is not None and listen_socket.getsockname()[1] != spec.port:
            raise CollectiveError(f"group {spec.group_id}: the reserved socket listens on port "
                                  f"{listen_socket.getsockname()[1]}, the spec names {spec.port}")
        if spec.backend == "gloo":
            import torch.distributed as dist

            store = _tcp_store(spec, rank, timeout, listen_socket)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(spec.group_id + "/", store), rank, spec.world_size, timeout)
            return cls(spec, rank, torch.device("cpu"), _pg=pg, _store=store)
        if spec.backend == "ipc":
            return cls._join_ipc(spec, rank, device, timeout, listen_socket)
        if not torch.cuda.is_available():
            raise CollectiveError(f"group {spec.group_id}: backend nccl needs CUDA on every member (this one has none)")
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        dev = _member_device(device)
        with torch.cuda.device(dev):
            pg = StatelessProcessGroup.create(spec.host, spec.port, rank, spec.world_size,
                                              store_timeout=int(spec.timeout_s),
                                              listen_socket=listen_socket if rank == 0 else None)
            comm = PyNcclCommunicator(pg, device=dev)
            if getattr(comm, "disabled", False):
                raise CollectiveError(f"group {spec.group_id}: vLLM's PyNccl is disabled here (VLLM_DISABLE_PYNCCL?)")
            stream = torch.cuda.Stream(device=dev)
        return cls(spec, rank, dev, _comm=comm, _stream=stream, _store=pg)

    @classmethod
    def _join_ipc(cls, spec: GroupSpec, rank: int, device: torch.device | str | None,
                  timeout: datetime.timedelta, listen_socket: socket.socket | None) -> "CollectiveGroup":
        """ipc: only the store (handles and acknowledgements travel through it); every member
        checks in and waits for the others, so a missing member fails the join, not the push."""
        store = _tcp_store(spec, rank, timeout, listen_socket)
        group = cls(spec, rank, _member_device(device), _store=store)
        key = f"{spec.group_id}/joined"
        store.add(key, 1)
        deadline = time.monotonic() + spec.timeout_s
        while store.add(key, 0) < spec.world_size:
            if time.monotonic() > deadline:
                group.close()
                raise CollectiveError(f"group {spec.group_id}: only {store.add(key, 0)} of {spec.world_size} members "
                                      f"joined within {spec.timeout_s}s")
            time.sleep(0.002)
        return group

    # ---- one broadcast from group rank 0 -------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        """Broadcast `tensor` from the sender into every member's `tensor` (same shape, dtype,
        and this member's device), returning once it is complete here. Raises CollectiveError
        (and the group is broken) if that does not happen by `deadline` (time.monotonic())."""
        if self.broken:
            raise CollectiveError(f"group {self.spec.group_id} is broken (an earlier step failed); form a new one")
        if self.spec.backend == "ipc":
            raise CollectiveError(f"group {self.spec.group_id}: an ipc group passes handles (send_stream), it does not broadcast")
        try:
            if self._pg is not None:
                import torch.distributed as dist

                opts = dist.BroadcastOptions()
                opts.rootRank, opts.rootTensor = 0, 0
                work = self._pg.broadcast([tensor], opts)
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            self._comm.broadcast(tensor, src=0, stream=self._stream)
            tensor.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
            while not done.query():
                if time.monotonic() > deadline:
                    raise TimeoutError("NCCL broadcast not complete by the deadline")
                time.sleep(0.0002)
        except Exception as err:
            self.broken = True
            self.close()
            raise CollectiveError(f"group {self.spec.group_id} rank {self.rank}: broadcast of {tensor.numel()} "
                                  f"{str(tensor.dtype).removeprefix('torch.')} failed: {type(err).__name__}: {err}") from err

    def broadcast_all(self, tensors: list[torch.Tensor], deadline: float) -> None:
        """`broadcast` of every tensor in order, enqueued back to back (no wait between them), then
        one wait for all: the whole version's buckets at wire speed. Same failure rules."""
        if len(tensors) <= 1:
            for t in tensors:
                self.broadcast(t, deadline)
            return
        if self.broken:
            raise CollectiveError(f"group {self.spec.group_id} is broken (an earlier step failed); form a new one")
        if self.spec.backend == "ipc":
            raise CollectiveError(f"group {self.spec.group_id}: an ipc group passes handles (send_stream), it does not broadcast")
        try:
            if self._pg is not None:
                import torch.distributed as dist

                works = []
                for t in tensors:
                    opts = dist.BroadcastOptions()
                    opts.rootRank, opts.rootTensor = 0, 0
                    works.append(self._pg.broadcast([t], opts))
                for work in works:
                    work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
                return
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in tensors:
                self._comm.broadcast(t, src=0, stream=self._stream)
                t.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
            while not done.query():
                if time.monotonic() > deadline:
                    raise TimeoutError("NCCL broadcasts not complete by the deadline")
                time.sleep(0.0002)
        except Exception as err:
            self.broken = True
            self.close()
            raise CollectiveError(f"group {self.spec.group_id} rank {self.rank}: broadcast of {len(tensors)} buckets "
                                  f"({sum(t.numel() for t in tensors)} elements) failed: {type(err).__name__}: {err}") from err

    def close(self) -> None:
        comm, self._comm, self._pg, self._store = self._comm, None, None, None
        self.broken = True
        self._opened.clear()
        self._ring = None
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # best effort: the process may be tearing down
                pass


# ---- the wire protocol of one push on one group ----------------------------------------------------


def encode_table(bucket: Bucket, digests: dict[str, bytes]) -> bytes:
    """A bucket's tensor table, engine rank and the sender's digests (in band), as JSON bytes."""
    return json.dumps({"m": [[m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in bucket.metas],
                       "r": bucket.rank, "d": {k: v.hex() for k, v in digests.items()}}).encode()


def decode_table(raw: bytes) -> tuple[list[TensorMeta], int | None, dict[str, bytes]]:
    table = json.loads(raw.decode())
    metas = [TensorMeta(n, d, tuple(s), int(o), int(b)) for n, d, s, o, b in table["m"]]
    return metas, table["r"], {k: bytes.fromhex(v) for k, v in table["d"].items()}


def _header(group: CollectiveGroup, kind: int, a: int = 0, b: int = 0) -> torch.Tensor:
    return torch.tensor([kind, a, b], dtype=torch.int64, device=group.device)


def _send_bytes(group: CollectiveGroup, raw: bytes, deadline: float) -> None:
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device)
    group.broadcast(t, deadline)


@dataclass
class SendResult:
    """What a sender hands back to the publisher: per-tensor digests in the push's verify mode,
    sizes and timings. Its host copies (for rollbacks, retries and late joiners) are still being
    made when it returns: `host_copies.result()` waits for them (hostcopy.py)."""

    host_copies: HostCopies | None = None
    digests: dict[str, bytes] = field(default_factory=dict)
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"pack": 0.0, "broadcast": 0.0, "host_copy": 0.0, "hash": 0.0})


def pack_stream(named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, device: torch.device, *,
                plan: Any = None, sender: int = 0, alloc: Callable[[int], torch.Tensor] | None = None) -> Iterator[Bucket]:
    """The sender's buckets on `device`: Hugging Face tensors as they come (`iter_buckets`), or,
    with a push `plan` (plan.py), this sender's buckets in the engines' layout. `alloc(nbytes)`
    supplies reused buffers (ipc)."""
    if plan is None:
        return iter_buckets(named_tensors, bucket_mb, device=device, alloc=alloc)
    from asyncrl.weightsync.plan import PlannedPacker

    buffer = None if alloc is None else (lambda b: alloc(b.nbytes))
    return PlannedPacker(plan, sender, device, buffer, host_numpy=False).pack(named_tensors)


def send_stream(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                verify: str, timeout_s: float, keep: Callable[[Bucket], Any] | None = None,
                plan: Any = None, sender: int = 0) -> SendResult:
    """The sender's loop for one push: bucket the stream on the tensors' device (in the engines'
    layout with a `plan`), hash each bucket (its digests go in band, before its bytes), send it,
    and start its host copy (`keep` is called with each finished copy, off the critical path).
    If the stream fails, the receivers are told (abort header) before the error propagates."""
    if group.spec.backend == "ipc":
        from asyncrl.weightsync.ipc import ipc_send_stream

        return ipc_send_stream(group, named_tensors, bucket_mb, verify=verify, timeout_s=timeout_s, keep=keep,
                               plan=plan, sender=sender)
    deadline = time.monotonic() + timeout_s
    out = SendResult()
    if group.spec.ipc_window == 0:
        return _send_whole(group, named_tensors, bucket_mb, verify=verify, deadline=deadline, keep=keep, plan=plan,
                           sender=sender, out=out)
    copies = out.host_copies = host_copies_for(group, keep, deadline)
    export = Export(pack_stream(named_tensors, bucket_mb, group.device, plan=plan, sender=sender), out)
    try:
        for bucket in export:
            digests, _ = hash_and_copy(copies, bucket, verify, out)
            t = time.perf_counter()
            table = encode_table(bucket, digests)
            group.broadcast(_header(group, _BUCKET, len(table), bucket.nbytes), deadline)
            _send_bytes(group, table, deadline)
            if bucket.nbytes:
                group.broadcast(bucket.buffer, deadline)
            out.seconds["broadcast"] += time.perf_counter() - t
            del bucket
    except BaseException:
        copies.close()
        if export.failed and not group.broken:  # tell the receivers, so they fail now rather than at their deadline
            try:
                group.broadcast(_header(group, _ABORT), deadline)
            except CollectiveError:
                pass
        raise
    group.broadcast(_header(group, _END), deadline)
    copies.finish()
    return out


def _send_whole(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *, verify: str,
                deadline: float, keep: Callable[[Bucket], Any] | None, plan: Any, sender: int, out: SendResult) -> SendResult:
    """ipc_window 0 on gloo / NCCL: pack every bucket, enqueue every digest, wait for the device
    once, send one table of every bucket, broadcast the buckets back to back, wait once. The host
    copies start after the broadcasts are enqueued (`full` verification hashes them, so there they
    start first)."""
    copies = out.host_copies = host_copies_for(group, keep, deadline, max_device=1 << 30)
    export = Export(pack_stream(named_tensors, bucket_mb, group.device, plan=plan, sender=sender), out)
    early = verify == "full"
    packed: list[tuple[Bucket, Callable[[], dict[str, bytes]]]] = []
    try:
        for bucket in export:
            finish, _ = hash_and_copy_lazy(copies if early else None, bucket, verify, out)
            packed.append((bucket, finish))
        t = time.perf_counter()
        tables = [[encode_table(bucket, finish()).decode(), bucket.nbytes] for bucket, finish in packed]  # one device wait
        raw = json.dumps(tables).encode()
        group.broadcast(_header(group, WHOLE, len(raw), sum(b.nbytes for b, _ in packed)), deadline)
        _send_bytes(group, raw, deadline)
        buffers = [b.buffer for b, _ in packed if b.nbytes]
        if not early:
            for bucket, _ in packed:  # enqueued behind the packing, beside the broadcasts
                t_copy = time.perf_counter()
                copies.add(bucket)
                out.seconds["host_copy"] += time.perf_counter() - t_copy
        group.broadcast_all(buffers, deadline)
        out.seconds["broadcast"] += time.perf_counter() - t
        packed.clear()
    except BaseException:
        copies.close()
        if export.failed and not group.broken:
            try:
                group.broadcast(_header(group, _ABORT), deadline)
            except CollectiveError:
                pass
        raise
    group.broadcast(_header(group, _END), deadline)
    copies.finish()
    return out


def host_copies_for(group: CollectiveGroup, keep: Callable[[Bucket], Any] | None, deadline: float,
                    max_device: int = 4, defer_keep: bool = False) -> HostCopies:
    """This push's host copies; an earlier push's that nobody collected are dropped first (their
    pinned buffers are this push's). `max_device`: sent device buckets whose copies may run at
    once (the sender frees a bucket only after its copy); `defer_keep`: see HostCopies."""
    if group._copies is not None and not group._copies.close():
        group._pinned = None  # still read by a stuck keep: this push copies into fresh buffers
    if group.device.type == "cuda" and group._pinned is None:
        group._pinned = PinnedPool()
    group._copies = HostCopies(keep, group._pinned, deadline=deadline, max_device=max_device, defer_keep=defer_keep)
    return group._copies


def hash_and_copy(copies: HostCopies, bucket: Bucket, verify: str, out: SendResult) -> tuple[dict[str, bytes], Any]:
    """Start `bucket`'s host copy and hash it in `verify` mode (where it lies: `full` reads every
    byte, from the host copy); returns its digests (they travel in band, before its bytes) and
    the copy (done once its device buffer may be reused)."""
    finish, copy = hash_and_copy_lazy(copies, bucket, verify, out)
    return finish(), copy


def hash_and_copy_lazy(copies: HostCopies | None, bucket: Bucket, verify: str,
                       out: SendResult) -> tuple[Callable[[], dict[str, bytes]], Any]:
    """`hash_and_copy` with the device reads only enqueued: the returned call waits for them and
    records the digests in `out` (a sender that publishes a whole version waits once, at its end).
    `copies` None: the caller starts the host copy itself (not with `full` verification)."""
    from asyncrl.weightsync.bucket import digest_key_prefix
    from asyncrl.weightsync.fingerprint import bucket_digests, bucket_digests_lazy

    t = time.perf_counter()
    if copies is None and verify == "full":
        raise ValueError("full verification hashes the host copy: start it here")
    copy = copies.add(bucket) if copies is not None else None
    out.num_buckets += 1
    out.seconds["host_copy"] += time.perf_counter() - t
    t = time.perf_counter()
    prefix = digest_key_prefix(bucket)
    if verify == "full":
        pending = lambda: bucket_digests(copies.host(copy), "full", prefix)  # type: ignore[union-attr]  # noqa: E731
    else:
        pending = bucket_digests_lazy(bucket, verify, prefix)  # type: ignore[arg-type]
    out.seconds["hash"] += time.perf_counter() - t
    out.bytes += bucket.payload_bytes
    out.num_tensors += len(bucket)

    def finish() -> dict[str, bytes]:
        t = time.perf_counter()
        digests = pending()
        out.digests.update(digests)
        out.seconds["hash"] += time.perf_counter() - t
        return digests

    return finish, copy


class Export:
    """The sender's bucket stream (timed as `pack`); `failed` tells an export error (the tensor
    stream raised) from a send error, which only the sender sees."""

    def __init__(self, buckets: Iterable[Bucket], out: SendResult) -> None:
        self._buckets = iter(buckets)
        self._out, self.failed = out, False

    def __iter__(self) -> Iterator[Bucket]:
        while True:
            t = time.perf_counter()
            try:
                bucket = next(self._buckets)
            except StopIteration:
                return
            except BaseException:
                self.failed = True
                raise
            self._out.seconds["pack"] += time.perf_counter() - t
            yield bucket


def receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[tuple[Bucket, dict[str, bytes]]]:
    """The receiver's loop for one push on one group: yields each bucket (its buffer on this
    member's device) with the sender's digests of it, until the sender's end header. Raises
    SenderAborted on an abort header."""
    if group.spec.backend == "ipc":
        from asyncrl.weightsync.ipc import ipc_receive_stream

        yield from ipc_receive_stream(group, deadline)
        return
    while True:
        header = torch.empty(3, dtype=torch.int64, device=group.device)
        group.broadcast(header, deadline)
        kind, table_len, nbytes = (int(v) for v in header.tolist())
        if kind == _END:
            return
        if kind == _ABORT:
            raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
        if kind == WHOLE and table_len > 0 and nbytes >= 0:
            yield from _receive_whole(group, table_len, nbytes, deadline)
            continue
        if kind != _BUCKET or table_len <= 0 or nbytes < 0:
            group.broken = True
            group.close()
            raise CollectiveError(f"group {group.spec.group_id}: malformed header {[kind, table_len, nbytes]}")
        raw = torch.empty(table_len, dtype=torch.uint8, device=group.device)
        group.broadcast(raw, deadline)
        metas, rank, digests = decode_table(raw.cpu().numpy().tobytes())
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        if nbytes:
            group.broadcast(buffer, deadline)
        yield Bucket(buffer=buffer, metas=metas, rank=rank), digests


def _receive_whole(group: CollectiveGroup, table_len: int, nbytes: int,
                   deadline: float) -> Iterator[tuple[Bucket, dict[str, bytes]]]:
    """A whole version: one table, then every bucket back to back into one allocation of
    `nbytes`, received before the first is handed on."""
    raw = torch.empty(table_len, dtype=torch.uint8, device=group.device)
    group.broadcast(raw, deadline)
    tables = json.loads(raw.cpu().numpy().tobytes().decode())
    sizes = [int(n) for _, n in tables]
    if sum(sizes) != nbytes or any(n < 0 for n in sizes):
        group.broken = True
        group.close()
        raise CollectiveError(f"group {group.spec.group_id}: a whole-version table of {sizes} bytes for a header of {nbytes}")
    block = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
    views, at = [], 0
    for n in sizes:
        views.append(block.narrow(0, at, n))
        at += n
    group.broadcast_all([v for v in views if v.numel()], deadline)
    for (table, _), view in zip(tables, views):
        metas, rank, digests = decode_table(table.encode())
        yield Bucket(buffer=view, metas=metas, rank=rank), digests
