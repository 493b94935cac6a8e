"""The ipc transport: the sending learner rank and the engine workers share a GPU, so a bucket travels as a handle.

Owns: `IpcRing` (a sender's device buffers, kept from push to push so a receiver opens each handle once, and its
stamp), `ipc_send` (pack, hash, stamp, register the host copies, answer one `IpcBucket` a bucket), `ipc_open` (a
receiver's view of the sender's buffer) and `ipc_wait`. No group: the handles are the same from push to push, so the
replicas' loads start with the export (the last push's handles in an `IpcReceive`), stage views and wait for the
sender's stamp of the attempt's token (written on its stream after the pack and its checksum) before hashing; the
commit copies from the views. A load whose handles moved fails at the stamp and the publisher loads the new ones. The
next push rewrites the buffers only after this one was committed or aborted (the publisher's order), its host copies
made or dropped first. Handles are keyed by GPU UUID (any CUDA_VISIBLE_DEVICES order); a host without CUDA refuses ipc.
Must never: rewrite a buffer a receiver may still read, free one a receiver still maps, or stamp before the bytes.
Details: docs/design/weightsync.md, "The ipc transport"."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from asyncrl.weightsync.bucket import Bucket, TensorMeta, windows
from asyncrl.weightsync.collective import CollectiveError, SenderAborted
from asyncrl.weightsync.stream import Export, SendResult, hash_whole_lazy, pack_stream
from asyncrl.weightsync.transport import HostCopies


class IpcRing:
    """Device buffers an ipc sender packs a whole version into, kept across pushes (`take_in_order`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.taken = 0  # buffers this push has packed into (the first `taken`, in order)
        # The handle of each view of a buffer, made once (`ipc_export`): sharing a storage again costs an event and a
        # reference-count slot, and receivers reopen nothing. Dropped on each allocation (an address may come back).
        self.exports: dict[tuple[int, int, int], bytes] = {}
        self.arena: torch.Tensor | None = None  # a planned whole-version push's one buffer (`plan_whole`)
        self.slots: list[tuple[int, int]] = []  # (offset, nbytes) of each planned bucket in the arena
        self.next_slot = 0
        # What the loads wait for (`ipc_wait`, `put_stamp`); never reallocated: a load holding handles of an older
        # layout reads it too, and fails on the generation.
        self.stamp = torch.zeros(1, dtype=torch.int64, device=device)
        self.generation = 0  # bumped whenever a buffer, or the slots a plan cut the arena into, change

    def _new(self, nbytes: int) -> torch.Tensor:
        self.exports.clear()
        self.generation += 1
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def plan_whole(self, sizes: list[int]) -> None:
        """The next whole-version pushes pack buckets of `sizes`, in order, into 256-byte aligned views of one buffer
        (kept while it fits): each side hashes the version in one kernel launch, a receiver maps one allocation."""
        offsets, total = windows(sizes, 256)
        if self.arena is None or self.arena.numel() < total:
            self.buffers = []  # per-bucket buffers of an earlier layout go
            self.arena = self._new(max(total, 256))
        slots = list(zip(offsets, map(int, sizes)))
        if slots != self.slots:
            self.generation += 1
        self.slots, self.next_slot = slots, 0

    def take_in_order(self, nbytes: int) -> torch.Tensor:
        """A push's k-th bucket: slot k of the arena (`plan_whole`), else buffer k (a plan packs the same sizes in the
        same order every push, so every buffer, and every handle a receiver opened, is reused)."""
        if self.next_slot < len(self.slots):
            offset, size = self.slots[self.next_slot]
            if size == nbytes:
                self.next_slot += 1
                return self.arena[offset : offset + nbytes]  # type: ignore[index]
            self.slots = []  # the push left its plan: the rest get buffers of their own
            self.generation += 1
        i, self.taken = self.taken, self.taken + 1
        if i == len(self.buffers):
            self.buffers.append(self._new(nbytes))
        elif self.buffers[i].numel() < nbytes:
            self.buffers[i] = self._new(nbytes)
        return self.buffers[i][:nbytes]

    def release_all(self) -> None:
        self.taken = self.next_slot = 0

    def put_stamp(self, token: int, ok: bool = True) -> None:
        """Stamp attempt `token` on the device stream, after everything enqueued before: `(token << GEN_BITS) |
        generation` (`ok`), or `-(token << GEN_BITS)` (it failed). One int64: a reader never sees half of it."""
        self.stamp.fill_(_stamp(token, self.generation) if ok else -(token << GEN_BITS))


GEN_BITS = 20  # a stamp's low bits: the ring's generation (mod 2^20); the token above them


def _stamp(token: int, generation: int) -> int:
    if not 0 < token < 1 << (63 - GEN_BITS):
        raise ValueError(f"an ipc push token must be in [1, 2^{63 - GEN_BITS}), got {token}")
    return (token << GEN_BITS) | (generation % (1 << GEN_BITS))


class IpcBucket(NamedTuple):
    """One bucket of an ipc push as every replica's load receives it: its CUDA IPC handle (pickled: it crosses
    vLLM's worker RPC as bytes), tensor table, and the sender's stamp handle and ring generation; a plain tuple on
    every wire."""

    handle: bytes
    metas: list[TensorMeta]
    rank: int | None = None
    stamp: bytes = b""
    generation: int = 0

    def wire(self) -> tuple[bytes, list[TensorMeta], int | None, bytes, int]:
        return self


@dataclass(frozen=True)
class IpcReceive:
    """The `load_bucket` payload of an ipc push: the buckets to open, and the attempt's `token`, which each of their
    senders stamps once its part of `version` is on the device (`ipc_wait`), within `timeout_s`."""

    buckets: tuple[IpcBucket, ...]
    version: int
    token: int
    timeout_s: float = 120.0


class IpcRingMoved(CollectiveError):
    """The sender packed this attempt into other buffers than the load's handles (the publisher loads those)."""


def ipc_wait(stamp: torch.Tensor, token: int, generation: int, deadline: float) -> None:
    """Return once the sender stamped attempt `token` on `stamp` (its bytes and checksum complete on the device) for
    buffers of `generation`; IpcRingMoved for other buffers, SenderAborted if it failed, CollectiveError at
    `deadline` (time.monotonic)."""
    want, delay = _stamp(token, generation), 5e-5
    while True:
        got = int(stamp.item())  # (a read of the sender's memory: its fill is stream-ordered after its bytes)
        if got == want:
            return
        if got >= 0 and got >> GEN_BITS == token:
            raise IpcRingMoved(f"the ipc sender packed attempt {token} into new buffers (generation "
                               f"{got % (1 << GEN_BITS)}, these are {generation % (1 << GEN_BITS)})")
        if got == -(token << GEN_BITS):
            raise SenderAborted(f"the ipc sender failed attempt {token}")
        if time.monotonic() > deadline:
            raise CollectiveError(f"the ipc sender did not stamp attempt {token} in time")
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def ipc_export(buf: torch.Tensor, cache: dict) -> bytes:
    """What a receiver needs to open the device buffer `buf` (pickled), made once per view of a ring's buffer
    (`cache`: `IpcRing.exports`)."""
    from torch.multiprocessing.reductions import reduce_tensor

    key = (buf.untyped_storage().data_ptr(), buf.storage_offset(), buf.numel())
    if key not in cache:
        _, args = reduce_tensor(buf)
        cache[key] = pickle.dumps({"uuid": _gpu_uuid(buf.device), "args": args, "nbytes": int(buf.numel())})
    return cache[key]


def ipc_open(handle: bytes, metas: list[TensorMeta], rank: int | None = None) -> Bucket:
    """A view of the sender's buffer `handle` names, valid until its next push (written in full before it answered)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    record = pickle.loads(handle)
    local = [i for i in range(torch.cuda.device_count()) if _gpu_uuid(torch.device("cuda", i)) == record["uuid"]]
    if not local:  # (no CUDA device here at all, too)
        raise CollectiveError(f"the ipc sender's GPU {record['uuid']} is not visible here "
                              "(ipc needs the learner's sending rank and the engine workers on the same GPU)")
    args = list(record["args"])
    args[6] = local[0]  # reduce_tensor's device index, in the sender's CUDA_VISIBLE_DEVICES numbering
    with torch.cuda.device(local[0]):
        # An already opened storage is reused (the sender's event is waited on only at the first
        # open: the sender waits for its pack to complete before it answers a handle).
        shared = rebuild_cuda_tensor(*args)
    return Bucket(buffer=shared.view(torch.uint8).reshape(-1)[: record["nbytes"]], metas=metas, rank=rank)


def ipc_send(ring: IpcRing, copies: HostCopies, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
             verify: str, token: int, plan: Any = None, sender: int = 0) -> tuple[list[IpcBucket], SendResult]:
    """One push attempt (`token`) from an ipc sender: pack the version into `ring` (the engines' layout with a `plan`),
    hash it in one pass, stamp the token after both on the device stream (the loads hash from there), wait for the
    device once, register its host copies in `copies` (made when collected) and answer each bucket's handle. The
    caller closed the last push's copies first (they read the ring); it stamps a failure (`put_stamp`)."""
    if ring.device.type != "cuda":
        raise CollectiveError(f"ipc shares CUDA memory; this sender's device is {ring.device}")
    out = SendResult(host_copies=copies)
    ring.release_all()  # the last push's buckets (or a failed one's: receivers dropped them)
    if plan is not None:
        ring.plan_whole([b.nbytes for b in plan.for_sender(sender)])
    buckets = list(Export(pack_stream(named_tensors, bucket_mb, ring.device, plan=plan, sender=sender,
                                      alloc=ring.take_in_order), out))
    finish = hash_whole_lazy(buckets, verify, out)  # one pass where the buckets share the ring's arena
    ring.put_stamp(token)
    t = time.perf_counter()
    stamp = ipc_export(ring.stamp.view(torch.uint8), ring.exports)
    handles = [IpcBucket(ipc_export(b.buffer, ring.exports), list(b.metas), b.rank, stamp, ring.generation)
               for b in buckets]
    out.seconds["broadcast"] += time.perf_counter() - t
    finish()
    torch.cuda.current_stream(ring.device).synchronize()  # (verify "off" enqueued no checksum to wait for)
    for bucket in buckets:
        copies.add(bucket)
    return handles, out
