"""The ipc transport: the sending learner rank and the engine workers share a GPU, so a bucket travels as a handle.

Owns: `IpcRing` (a sender's device buffers, kept from push to push so a receiver opens each handle once), `ipc_send`
(pack, hash, register the host copies, answer one `IpcBucket` a bucket) and `ipc_open` (a receiver's view of the
sender's buffer). No group, no acknowledgement: the publisher hands the handles to every replica's load once the
export returned, the workers stage views, the commit copies from them. The next push rewrites the buffers only after
this one was committed or aborted (the publisher's order), its host copies made or dropped first. Handles are keyed
by GPU UUID (any CUDA_VISIBLE_DEVICES order); a host without CUDA refuses ipc.
Must never: rewrite a buffer a receiver may still read, or free one a receiver still maps.
Details: docs/design/weightsync.md, "The ipc transport"."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from asyncrl.weightsync.bucket import Bucket, TensorMeta, windows
from asyncrl.weightsync.collective import CollectiveError
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

    def _new(self, nbytes: int) -> torch.Tensor:
        self.exports.clear()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def plan_whole(self, sizes: list[int]) -> None:
        """The next whole-version pushes pack buckets of `sizes`, in order, into 256-byte aligned views of one buffer
        (kept while it fits): each side hashes the version in one kernel launch, a receiver maps one allocation."""
        offsets, total = windows(sizes, 256)
        if self.arena is None or self.arena.numel() < total:
            self.buffers = []  # per-bucket buffers of an earlier layout go
            self.arena = self._new(max(total, 256))
        self.slots, self.next_slot = list(zip(offsets, map(int, sizes))), 0

    def take_in_order(self, nbytes: int) -> torch.Tensor:
        """A push's k-th bucket: slot k of the arena (`plan_whole`), else buffer k (a plan packs the same sizes in the
        same order every push, so every buffer, and every handle a receiver opened, is reused)."""
        if self.next_slot < len(self.slots):
            offset, size = self.slots[self.next_slot]
            if size == nbytes:
                self.next_slot += 1
                return self.arena[offset : offset + nbytes]  # type: ignore[index]
            self.slots = []  # the push left its plan: the rest get buffers of their own
        i, self.taken = self.taken, self.taken + 1
        if i == len(self.buffers):
            self.buffers.append(self._new(nbytes))
        elif self.buffers[i].numel() < nbytes:
            self.buffers[i] = self._new(nbytes)
        return self.buffers[i][:nbytes]

    def release_all(self) -> None:
        self.taken = self.next_slot = 0


class IpcBucket(NamedTuple):
    """One bucket of an ipc push as every replica's load receives it: its CUDA IPC handle (pickled: it crosses
    vLLM's worker RPC as bytes) and tensor table; a plain tuple on every wire."""

    handle: bytes
    metas: list[TensorMeta]
    rank: int | None = None

    def wire(self) -> tuple[bytes, list[TensorMeta], int | None]:
        return self


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
             verify: str, plan: Any = None, sender: int = 0) -> tuple[list[IpcBucket], SendResult]:
    """One push from an ipc sender: pack the version into `ring` (the engines' layout with a `plan`), wait for the
    device once, hash it in one pass, register its host copies in `copies` (made when collected), and answer each
    bucket's handle. The caller closed the last push's copies first (they read the ring)."""
    if ring.device.type != "cuda":
        raise CollectiveError(f"ipc shares CUDA memory; this sender's device is {ring.device}")
    out = SendResult(host_copies=copies)
    ring.release_all()  # the last push's buckets (or a failed one's: receivers dropped them)
    if plan is not None:
        ring.plan_whole([b.nbytes for b in plan.for_sender(sender)])
    buckets = list(Export(pack_stream(named_tensors, bucket_mb, ring.device, plan=plan, sender=sender,
                                      alloc=ring.take_in_order), out))
    t = time.perf_counter()
    torch.cuda.current_stream(ring.device).synchronize()  # the bytes are complete before anyone reads them
    handles = [IpcBucket(ipc_export(b.buffer, ring.exports), list(b.metas), b.rank) for b in buckets]
    out.seconds["broadcast"] += time.perf_counter() - t
    hash_whole_lazy(buckets, verify, out)()  # one pass where the buckets share the ring's arena
    for bucket in buckets:
        copies.add(bucket)
    return handles, out
