"""The ipc transport: sender and engine workers share a device, so a bucket travels as a handle.

Owns: one push on an ipc group (collective.py's `CollectiveGroup` with backend "ipc"). The
sender packs each bucket into a buffer of its `IpcRing` (device buffers kept for the group's
life and reused by every push, so each receiver opens each buffer's CUDA IPC handle once, not
once per bucket per push: opening a handle costs more than copying a 64 MiB bucket on an H100),
publishes the handle and the bucket's tensor table with the sender's digests in the group's
TCPStore, and each receiver copies the bucket into its own memory (device to device) and
acknowledges it. A buffer is reused once every receiver acknowledged its bucket and its host
copy is made; at most `IPC_WINDOW` buckets are published unacknowledged. A CPU bucket goes as a
shared-memory file instead. A receiver that fails records why in the store and the sender stops
at once instead of waiting out its deadline; an export that fails tells the receivers (abort).

Handles are keyed by GPU UUID, so a receiver with another CUDA_VISIBLE_DEVICES order opens the
same physical GPU.

Must never: reuse a buffer a receiver may still read, or free one a receiver still maps.
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from asyncrl.weightsync.bucket import Bucket, SharedBucket, TensorMeta, write_shared
from asyncrl.weightsync.collective import (
    ABORT,
    BUCKET,
    END,
    CollectiveError,
    CollectiveGroup,
    Export,
    SenderAborted,
    SendResult,
    decode_table,
    encode_table,
    hash_and_copy,
    host_copies_for,
    pack_stream,
)

IPC_WINDOW = 2  # buckets an ipc sender keeps published (and unacknowledged) before waiting


class IpcRing:
    """Device buffers an ipc sender packs buckets into, kept across pushes. `take(nbytes)` hands
    out a free one (growing or adding one when none fits); `free` returns it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.busy: list[bool] = []

    def take(self, nbytes: int) -> torch.Tensor:
        free = [i for i, b in enumerate(self.busy) if not b]
        fits = [i for i in free if self.buffers[i].numel() >= nbytes]
        if fits:
            i = min(fits, key=lambda j: self.buffers[j].numel())
        elif free:  # grow a free one (a larger bucket than before): a new handle for it
            i = free[0]
            self.buffers[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        else:
            self.buffers.append(torch.empty(nbytes, dtype=torch.uint8, device=self.device))
            self.busy.append(False)
            i = len(self.buffers) - 1
        self.busy[i] = True
        return self.buffers[i][:nbytes]

    def free(self, view: torch.Tensor) -> None:
        for i, b in enumerate(self.buffers):
            if b.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                self.busy[i] = False
                return

    def release_all(self) -> None:
        self.busy = [False] * len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buffers)


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def ipc_export(bucket: Bucket) -> tuple[dict[str, Any], Any]:
    """(what a receiver needs to open `bucket`, what the sender must keep until it is acknowledged)."""
    if isinstance(bucket.buffer, torch.Tensor) and bucket.buffer.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(bucket.buffer)
        return {"kind": "cuda", "uuid": _gpu_uuid(bucket.buffer.device), "args": args}, bucket
    shared = write_shared(bucket)
    return {"kind": "file", "path": shared.path}, shared


def _ipc_free(kept: Any) -> None:
    if isinstance(kept, SharedBucket):
        kept.unlink()


def ipc_open(handle: dict[str, Any], metas: list[TensorMeta], nbytes: int, device: torch.device,
             opened: dict | None = None, rank: int | None = None) -> Bucket:
    """Open a published bucket and copy it into this member's memory on `device`. `opened`
    caches the sender's buffers by handle (kept open: the sender reuses them)."""
    if handle["kind"] == "file":
        # Mapped copy-on-write: the mapping outlives the sender's unlink, so no copy is needed on a CPU member.
        bucket = SharedBucket(handle["path"], metas, nbytes, rank).open()
        if device.type != "cpu":
            return Bucket(buffer=torch.from_numpy(bucket.buffer).to(device), metas=metas, rank=rank)
        return bucket
    if handle["kind"] != "cuda":
        raise CollectiveError(f"unknown ipc handle kind {handle['kind']!r}")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise CollectiveError("an ipc sender published a CUDA bucket but this member has no CUDA device")
    local = [i for i in range(torch.cuda.device_count()) if _gpu_uuid(torch.device("cuda", i)) == handle["uuid"]]
    if not local:
        raise CollectiveError(f"the ipc sender's GPU {handle['uuid']} is not visible here "
                              "(ipc needs the learner's sending rank and the engine workers on the same GPU)")
    args = list(handle["args"])
    args[6] = local[0]  # reduce_tensor's device index, in the sender's CUDA_VISIBLE_DEVICES numbering
    target = device if device.type == "cuda" else torch.device("cuda", local[0])
    with torch.cuda.device(local[0]):
        shared = rebuild_cuda_tensor(*args)  # an already opened storage is reused; waits on the sender's event
        own = torch.empty(nbytes, dtype=torch.uint8, device=target)
        own.copy_(shared.view(torch.uint8).reshape(-1)[:nbytes])
        torch.cuda.synchronize(local[0])  # the copy is complete before the sender may reuse its buffer
    if opened is not None:  # keep the storage alive, so the next push's handle to it needs no new open
        opened[(args[7], args[9])] = shared
    return Bucket(buffer=own, metas=metas, rank=rank)


def _key(group: CollectiveGroup, what: str) -> str:
    return f"{group.spec.group_id}/{group._pushes}/{what}"


def _failed(group: CollectiveGroup, error: BaseException, report: str | None = None) -> CollectiveError:
    """Break and close the group; a receiver first records `report` in the store for the sender."""
    if report is not None and group._store is not None:
        try:
            group._store.set(_key(group, "failed"), f"rank {group.rank}: {report}"[:2000])
        except Exception:  # the store (the sender's process) may be gone
            pass
    group.broken = True
    group.close()
    if isinstance(error, CollectiveError):
        return error
    return CollectiveError(f"group {group.spec.group_id} rank {group.rank}: ipc step failed: {type(error).__name__}: {error}")


def _wait_acks(group: CollectiveGroup, k: int, deadline: float) -> None:
    store, want = group._store, group.spec.world_size - 1
    ack, failed = _key(group, f"a{k}"), _key(group, "failed")
    while store.add(ack, 0) < want:
        if store.check([failed]):
            raise CollectiveError(f"group {group.spec.group_id}: a receiver failed: {store.get(failed).decode(errors='replace')}")
        if time.monotonic() > deadline:
            raise CollectiveError(f"group {group.spec.group_id}: bucket {k} acknowledged by {store.add(ack, 0)} of "
                                  f"{want} receivers by the deadline")
        time.sleep(0.0002)


def _retire(group: CollectiveGroup, k: int, kept: Any, copy: Any, deadline: float) -> None:
    """Bucket `k` is acknowledged by every receiver: once its host copy has read it too, its
    buffer goes back to the ring (a file is unlinked); its keys are dropped (the store stays small)."""
    if isinstance(kept, Bucket) and group._ring is not None:
        if copy is not None:
            copy.wait(deadline)
        group._ring.free(kept.buffer)
    _ipc_free(kept)
    for what in (f"b{k}", f"a{k}"):
        group._store.delete_key(_key(group, what))


def ipc_send_stream(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                    verify: str, timeout_s: float, keep: Callable[[Bucket], Any] | None,
                    plan: Any = None, sender: int = 0) -> SendResult:
    if group.broken or group._store is None:
        raise CollectiveError(f"group {group.spec.group_id} is broken (an earlier step failed); form a new one")
    store, deadline, out = group._store, time.monotonic() + timeout_s, SendResult()
    for key in group._leftover:  # the last push's end marker: every receiver has read it by now
        store.delete_key(key)
    group._pushes += 1
    group._leftover = [_key(group, w) for w in ("aborted", "failed")]
    alloc = None
    if group.device.type == "cuda":
        if group._ring is None:
            group._ring = IpcRing(group.device)
        group._ring.release_all()  # the last push retired all of its buckets (or failed: receivers dropped them)
        alloc = group._ring.take
    published: deque[tuple[int, Any, Any]] = deque()
    copies = out.host_copies = host_copies_for(group, keep, deadline)
    export = Export(pack_stream(named_tensors, bucket_mb, group.device, plan=plan, sender=sender, alloc=alloc), out)
    k = 0
    try:
        for bucket in export:
            digests, copy = hash_and_copy(copies, bucket, verify, out)  # in band, before the receivers read it
            t = time.perf_counter()
            while len(published) >= IPC_WINDOW:
                done, kept, done_copy = published.popleft()
                _wait_acks(group, done, deadline)
                _retire(group, done, kept, done_copy, deadline)
            handle, kept = ipc_export(bucket)
            store.set(_key(group, f"b{k}"), pickle.dumps({"kind": BUCKET, "handle": handle, "nbytes": bucket.nbytes,
                                                          "table": encode_table(bucket, digests)}))
            published.append((k, kept, copy))
            out.seconds["broadcast"] += time.perf_counter() - t
            del bucket
            k += 1
        store.set(_key(group, f"b{k}"), pickle.dumps({"kind": END}))
        group._leftover.append(_key(group, f"b{k}"))
        t = time.perf_counter()
        while published:
            done, kept, done_copy = published.popleft()
            _wait_acks(group, done, deadline)
            _retire(group, done, kept, done_copy, deadline)
        out.seconds["broadcast"] += time.perf_counter() - t
        copies.finish()
    except BaseException as err:
        copies.close()
        try:  # receivers stop at once instead of at their deadline (before any handle they may hold is freed)
            store.set(_key(group, "aborted"), b"1")
            store.set(_key(group, f"b{k}"), pickle.dumps({"kind": ABORT}))
        except Exception:
            pass
        for _, kept, _ in published:
            _ipc_free(kept)
        group._leftover += [_key(group, f"{w}{j}") for j in range(k + 1) for w in "ba"]
        if export.failed or not isinstance(err, Exception):
            raise  # the protocol stayed in step (receivers read the abort): the group carries the next push
        # The channel failed (a receiver failed or missed the deadline): broken, but the store this
        # rank hosts stays up until the group is left, so the other receivers can still read the abort.
        group.broken = True
        if isinstance(err, CollectiveError):
            raise
        raise CollectiveError(f"group {group.spec.group_id} rank 0: ipc send failed: {type(err).__name__}: {err}") from err
    return out


def ipc_receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[tuple[Bucket, dict[str, bytes]]]:
    if group.broken or group._store is None:
        raise CollectiveError(f"group {group.spec.group_id} is broken (an earlier step failed); form a new one")
    store = group._store
    group._pushes += 1
    k = 0
    try:
        while True:
            key = _key(group, f"b{k}")
            store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            record = pickle.loads(store.get(key))
            if record["kind"] == END:
                return
            if record["kind"] == ABORT:  # the sender knows; this group stays usable for the next push
                raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
            metas, rank, digests = decode_table(record["table"])
            try:
                bucket = ipc_open(record["handle"], metas, int(record["nbytes"]), group.device, group._opened, rank)
            except Exception:
                if store.check([_key(group, "aborted")]):  # freed by the sender's abort, not broken
                    raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push") from None
                raise
            store.add(_key(group, f"a{k}"), 1)
            yield bucket, digests
            k += 1
    except SenderAborted:
        raise
    except Exception as err:
        raise _failed(group, err, report=f"{type(err).__name__}: {err}") from err
    except BaseException:  # the consumer stopped reading mid-push (its staging failed) or was interrupted
        _failed(group, CollectiveError(f"stopped reading at bucket {k}"), report=f"stopped reading at bucket {k}")
        raise
