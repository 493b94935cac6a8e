"""Collective transports: buckets broadcast from the sending learner ranks straight into the engine
workers' memory, over NCCL on GPUs (vLLM's `PyNcclCommunicator` on a `StatelessProcessGroup`) or
gloo on CPU hosts (torch's `ProcessGroupGloo` on its own TCPStore), the same code either way.

Owns: the group description (`GroupSpec`: one group per sending rank, that rank is group rank 0
and every engine worker of every replica a receiver), `CollectiveGroup` (join, broadcast with a
deadline, close), the wire protocol of one push on a group (per bucket: a 3 x int64 header, the
tensor table as JSON bytes, the bucket buffer; then an end or abort header), `send_stream` (the
sender's loop: pack on the tensors' device, broadcast, keep a host copy, hash in the verify mode)
and `receive_stream` (the receiver's loop: allocate on its device, receive, hand each bucket on).

Memory: the sender holds one packed bucket on its device at a time (plus its host copy while it
is put). Each engine worker stages the complete new version (full HF tensors, not its TP shard)
in its device memory until commit, because the commit is atomic: a worker needs headroom for one
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

BACKENDS = ("gloo", "nccl")
# Header kinds (first int64 of a header): a bucket follows, the sender is done, the sender failed.
_BUCKET, _END, _ABORT = 1, 2, 3


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

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got {self.backend!r}")
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
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def form_specs(backend: str, senders: list[tuple[str, int]], replica_workers: dict[str, int], *,
               timeout_s: float, group_prefix: str) -> list[GroupSpec]:
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
    return [GroupSpec(f"{group_prefix}-s{i}", backend, host, port, nxt, dict(receivers), i, timeout_s)
            for i, (host, port) in enumerate(senders)]


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

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, device: torch.device | str | None = None) -> "CollectiveGroup":
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if spec.backend == "gloo":
            import torch.distributed as dist

            store = dist.TCPStore(spec.host, spec.port, spec.world_size, rank == 0, timeout=timeout,
                                  wait_for_workers=False)
            pg = dist.ProcessGroupGloo(dist.PrefixStore(spec.group_id + "/", store), rank, spec.world_size, timeout)
            return cls(spec, rank, torch.device("cpu"), _pg=pg, _store=store)
        if not torch.cuda.is_available():
            raise CollectiveError(f"group {spec.group_id}: backend nccl needs CUDA on every member (this one has none)")
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(dev):
            pg = StatelessProcessGroup.create(spec.host, spec.port, rank, spec.world_size,
                                              store_timeout=int(spec.timeout_s))
            comm = PyNcclCommunicator(pg, device=dev)
            if getattr(comm, "disabled", False):
                raise CollectiveError(f"group {spec.group_id}: vLLM's PyNccl is disabled here (VLLM_DISABLE_PYNCCL?)")
            stream = torch.cuda.Stream(device=dev)
        return cls(spec, rank, dev, _comm=comm, _stream=stream, _store=pg)

    # ---- one broadcast from group rank 0 -------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, deadline: float) -> None:
        """Broadcast `tensor` from the sender into every member's `tensor` (same shape, dtype,
        and this member's device), returning once it is complete here. Raises CollectiveError
        (and the group is broken) if that does not happen by `deadline` (time.monotonic())."""
        if self.broken:
            raise CollectiveError(f"group {self.spec.group_id} is broken (an earlier step failed); form a new one")
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

    def close(self) -> None:
        comm, self._comm, self._pg, self._store = self._comm, None, None, None
        self.broken = True
        if comm is not None:
            try:
                comm.destroy()
            except Exception:  # best effort: the process may be tearing down
                pass


# ---- the wire protocol of one push on one group ----------------------------------------------------


def _encode_metas(metas: list[TensorMeta]) -> bytes:
    return json.dumps([[m.name, m.dtype, list(m.shape), m.offset, m.nbytes] for m in metas]).encode()


def _decode_metas(raw: bytes) -> list[TensorMeta]:
    return [TensorMeta(n, d, tuple(s), int(o), int(b)) for n, d, s, o, b in json.loads(raw.decode())]


def _header(group: CollectiveGroup, kind: int, a: int = 0, b: int = 0) -> torch.Tensor:
    return torch.tensor([kind, a, b], dtype=torch.int64, device=group.device)


def _send_bytes(group: CollectiveGroup, raw: bytes, deadline: float) -> None:
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(group.device)
    group.broadcast(t, deadline)


@dataclass
class SendResult:
    """What a sender hands back to the publisher: the host copies (for rollback, retries and late
    joiners), per-tensor digests in the push's verify mode, and timings."""

    host_buckets: list[Bucket] = field(default_factory=list)
    digests: dict[str, bytes] = field(default_factory=dict)
    bytes: int = 0
    num_tensors: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"pack": 0.0, "broadcast": 0.0, "host_copy": 0.0, "hash": 0.0})


def send_stream(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                verify: str, timeout_s: float, on_host_bucket: Callable[[Bucket], Any] | None = None) -> SendResult:
    """The sender's loop for one push: bucket the stream on the tensors' device, broadcast each
    bucket, copy it to host (`on_host_bucket` may put it somewhere) and hash that copy. If the
    stream fails, the receivers are told (abort header) before the error propagates."""
    from asyncrl.generator.weights import tensor_digest
    from asyncrl.weightsync.bucket import unpack_bucket

    deadline = time.monotonic() + timeout_s
    out = SendResult()
    buckets = iter_buckets(named_tensors, bucket_mb, device=group.device)
    while True:
        t = time.perf_counter()
        try:
            bucket = next(buckets)
        except StopIteration:
            break
        except BaseException:
            if not group.broken:  # tell the receivers, so they fail now rather than at their deadline
                try:
                    group.broadcast(_header(group, _ABORT), deadline)
                except CollectiveError:
                    pass
            raise
        out.seconds["pack"] += time.perf_counter() - t
        t = time.perf_counter()
        meta_raw = _encode_metas(bucket.metas)
        group.broadcast(_header(group, _BUCKET, len(meta_raw), bucket.nbytes), deadline)
        _send_bytes(group, meta_raw, deadline)
        if bucket.nbytes:
            group.broadcast(bucket.buffer, deadline)
        out.seconds["broadcast"] += time.perf_counter() - t
        t = time.perf_counter()
        host = bucket.to_host()
        del bucket
        out.seconds["host_copy"] += time.perf_counter() - t
        t = time.perf_counter()
        for name, tensor in unpack_bucket(host):
            out.digests[name] = tensor_digest(name, tensor, verify)
        out.seconds["hash"] += time.perf_counter() - t
        out.bytes += host.payload_bytes
        out.num_tensors += len(host)
        out.host_buckets.append(on_host_bucket(host) if on_host_bucket is not None else host)
    group.broadcast(_header(group, _END), deadline)
    return out


def receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[Bucket]:
    """The receiver's loop for one push on one group: yields each bucket (its buffer on this
    member's device) until the sender's end header. Raises SenderAborted on an abort header."""
    while True:
        header = torch.empty(3, dtype=torch.int64, device=group.device)
        group.broadcast(header, deadline)
        kind, meta_len, nbytes = (int(v) for v in header.tolist())
        if kind == _END:
            return
        if kind == _ABORT:
            raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
        if kind != _BUCKET or meta_len <= 0 or nbytes < 0:
            group.broken = True
            group.close()
            raise CollectiveError(f"group {group.spec.group_id}: malformed header {[kind, meta_len, nbytes]}")
        raw = torch.empty(meta_len, dtype=torch.uint8, device=group.device)
        group.broadcast(raw, deadline)
        metas = _decode_metas(raw.cpu().numpy().tobytes())
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        if nbytes:
            group.broadcast(buffer, deadline)
        yield Bucket(buffer=buffer, metas=metas)
