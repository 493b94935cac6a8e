"""The ipc transport: sender and engine workers share a device, so a bucket travels as a handle.

Owns: one push on an ipc group (collective.py's `CollectiveGroup`, backend "ipc"). The sender packs the whole version
into the buffers of its `IpcRing` (kept for the group's life, so each receiver opens each CUDA IPC handle once, not
per push) and publishes one record of every bucket's handle and tensor table in the group's TCPStore (a CPU bucket
goes as a shared-memory file); the ring is the receivers' staging area: they stage views of it, acknowledge once,
and the commit copies from it.
Handles are keyed by GPU UUID (any CUDA_VISIBLE_DEVICES order); a failing receiver or export stops the other side.
Must never: reuse a buffer a receiver may still read (only once every receiver acknowledged it and its host copy is
made; the ring is rewritten only by the next push), or free one a receiver still maps.
Details: docs/design/weightsync.md, "The ipc transport".
"""

from __future__ import annotations

import datetime
import pickle
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import torch

from asyncrl.weightsync.bucket import Bucket, SharedBucket, TensorMeta, windows, write_shared
from asyncrl.weightsync.collective import ABORT, WHOLE, CollectiveError, CollectiveGroup, SenderAborted
from asyncrl.weightsync.stream import Export, SendResult, decode_table, encode_table, hash_whole_lazy, host_copies_for, pack_stream


class IpcRing:
    """Device buffers an ipc sender packs a whole version into, kept across pushes (`take_in_order`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor] = []
        self.taken = 0  # buffers this push has packed into (the first `taken`, in order)
        # The handle published for each view of a buffer, made once (`ipc_export`): sharing a CUDA
        # storage again costs an event and a reference-count slot each time, and the receivers
        # reopen nothing. Dropped whenever a buffer is allocated (an address may come back).
        self.exports: dict[tuple[int, int, int], dict[str, Any]] = {}
        # A whole-version push with a plan: one buffer for every bucket (`plan_whole`).
        self.arena: torch.Tensor | None = None
        self.slots: list[tuple[int, int]] = []  # (offset, nbytes) of each planned bucket in the arena
        self.next_slot = 0

    def _new(self, nbytes: int) -> torch.Tensor:
        self.exports.clear()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def plan_whole(self, sizes: list[int]) -> None:
        """The next whole-version pushes pack buckets of `sizes`, in this order: each gets a view of
        one buffer (256-byte aligned), so each side hashes the whole version in one kernel launch
        and a receiver maps one allocation. The buffer is kept while it fits."""
        offsets, total = windows(sizes, 256)
        if self.arena is None or self.arena.numel() < total:
            self.buffers = []  # per-bucket buffers of an earlier layout go
            self.arena = self._new(max(total, 256))
        self.slots, self.next_slot = list(zip(offsets, map(int, sizes))), 0

    def take_in_order(self, nbytes: int) -> torch.Tensor:
        """A whole-version push: its k-th bucket gets slot k of the arena (`plan_whole`), else buffer
        k (a plan packs the same sizes in the same order every push, so every buffer, and every
        handle a receiver opened, is reused)."""
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

    @property
    def nbytes(self) -> int:
        return sum(int(b.numel()) for b in self.buffers) + (0 if self.arena is None else int(self.arena.numel()))


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def ipc_export(bucket: Bucket, cache: dict | None = None) -> tuple[dict[str, Any], Any]:
    """(what a receiver needs to open `bucket`, what the sender must keep until it is acknowledged).
    `cache`: a ring's handles by view (`IpcRing.exports`), reused for the same view of the same buffer."""
    buf = bucket.buffer
    if isinstance(buf, torch.Tensor) and buf.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        key = (buf.untyped_storage().data_ptr(), buf.storage_offset(), buf.numel())
        handle = cache.get(key) if cache is not None else None
        if handle is None:
            _, args = reduce_tensor(buf)
            handle = {"kind": "cuda", "uuid": _gpu_uuid(buf.device), "args": args}
            if cache is not None:
                cache[key] = handle
        return handle, bucket
    shared = write_shared(bucket)
    return {"kind": "file", "path": shared.path}, shared


def _ipc_free(kept: Any) -> None:
    if isinstance(kept, SharedBucket):
        kept.unlink()


def ipc_open(handle: dict[str, Any], metas: list[TensorMeta], nbytes: int, device: torch.device,
             opened: dict | None = None, rank: int | None = None, copy: bool = True) -> Bucket:
    """Open a published bucket and copy it into this member's memory on `device`. `opened`
    caches the sender's buffers by handle (kept open: the sender reuses them). `copy=False`
    (whole-version pushes): a view of the sender's buffer itself, valid until its next push; the
    sender finished writing it before it published the handle."""
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
        # An already opened storage is reused (the sender's event is waited on only at the first
        # open: the sender waits for its pack to complete before it publishes a handle).
        shared = rebuild_cuda_tensor(*args)
        if opened is not None:  # keep the storage alive, so the next push's handle to it needs no new open
            opened[(args[7], args[9])] = shared
        if not copy:
            return Bucket(buffer=shared.view(torch.uint8).reshape(-1)[:nbytes], metas=metas, rank=rank)
        own = torch.empty(nbytes, dtype=torch.uint8, device=target)
        own.copy_(shared.view(torch.uint8).reshape(-1)[:nbytes])
        torch.cuda.synchronize(local[0])  # the copy is complete before the sender may reuse its buffer
    return Bucket(buffer=own, metas=metas, rank=rank)


def _key(group: CollectiveGroup, what: str) -> str:
    return f"{group.spec.group_id}/{group._pushes}/{what}"


def cancel_key(group_id: str) -> str:
    """Where a publisher that saw every receiver of a push return stops a sender still waiting for
    an acknowledgement (a member died or never heard of the push: nobody else would tell it)."""
    return f"{group_id}/cancel"


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
    ack, failed, cancel = _key(group, f"a{k}"), _key(group, "failed"), cancel_key(group.spec.group_id)
    polls = 0
    while store.add(ack, 0) < want:
        if store.check([failed]):
            raise CollectiveError(f"group {group.spec.group_id}: a receiver failed: {store.get(failed).decode(errors='replace')}")
        polls += 1
        if polls % 64 == 0 and store.check([cancel]):  # (every ~15 ms: only a member that is gone leaves it there)
            raise CollectiveError(f"group {group.spec.group_id}: bucket {k} acknowledged by {store.add(ack, 0)} of {want} "
                                  f"receivers, and the publisher stopped the push: {store.get(cancel).decode(errors='replace')}")
        if time.monotonic() > deadline:
            raise CollectiveError(f"group {group.spec.group_id}: bucket {k} acknowledged by {store.add(ack, 0)} of "
                                  f"{want} receivers by the deadline")
        time.sleep(0.0002)


def ipc_send_stream(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *,
                    verify: str, timeout_s: float, keep: Callable[[Bucket], Any] | None,
                    plan: Any = None, sender: int = 0) -> SendResult:
    if group.broken or group._store is None:
        raise CollectiveError(f"group {group.spec.group_id} is broken (an earlier step failed); form a new one")
    store, deadline, out = group._store, time.monotonic() + timeout_s, SendResult()
    for key in group._leftover:  # the last push's end marker: every receiver has read it by now
        store.delete_key(key)
    group._pushes += 1
    # (a publisher's cancel of the last push, if it came after that push ended, goes too)
    group._leftover = [_key(group, w) for w in ("aborted", "failed")] + [cancel_key(group.spec.group_id)]
    alloc = None
    if group.device.type == "cuda":
        if group._ring is None:
            group._ring = IpcRing(group.device)
        if group._copies is not None:  # the last push's deferred host copies (if nobody collected them) start now
            group._copies.start_copies()
        for copy in group._ring_copies:  # a whole-version push's host copies read its buffers to the end
            copy.wait(deadline)
        group._ring_copies = []
        group._ring.release_all()  # the last push's buckets (or a failed one's: receivers dropped them)
        if plan is not None:
            group._ring.plan_whole([b.nbytes for b in plan.for_sender(sender)])
        alloc = group._ring.take_in_order
    return _send_whole(group, named_tensors, bucket_mb, verify=verify, deadline=deadline, keep=keep, plan=plan,
                       sender=sender, alloc=alloc, out=out)


def _abort_send(group: CollectiveGroup, copies: Any, at: str, leftover: list[str]) -> None:
    """A push failed on the sender: drop its host copies and tell the receivers at once (an abort
    record at key `at`, unless the push's record is there already) instead of at their deadline;
    the push's keys go when the next push starts."""
    copies.close()
    store = group._store
    try:
        store.set(_key(group, "aborted"), b"1")
        if not store.check([_key(group, at)]):
            store.set(_key(group, at), pickle.dumps({"kind": ABORT}))
    except Exception:  # the store is gone too
        pass
    group._leftover += leftover


def _raise_send_failure(group: CollectiveGroup, err: BaseException, export: Export) -> NoReturn:
    if export.failed or not isinstance(err, Exception):
        raise err  # the protocol stayed in step (receivers read the abort): the group carries the next push
    # The channel failed (a receiver failed or missed the deadline): broken, but the store this
    # rank hosts stays up until the group is left, so the other receivers can still read the abort.
    group.broken = True
    if isinstance(err, CollectiveError):
        raise err
    raise CollectiveError(f"group {group.spec.group_id} rank 0: ipc send failed: {type(err).__name__}: {err}") from err


def _send_whole(group: CollectiveGroup, named_tensors: Iterable[tuple[str, Any]], bucket_mb: float, *, verify: str,
                deadline: float, keep: Callable[[Bucket], Any] | None, plan: Any, sender: int,
                alloc: Callable[[int], torch.Tensor] | None, out: SendResult) -> SendResult:
    """Pack every bucket (into the ring, kept until the next push: the receivers stage views of it),
    wait for the device once, publish one record with every bucket, then enqueue the checksums (beside
    the receivers' staging) and wait for every receiver to have staged all of it, then for the digests."""
    store = group._store
    # The ring keeps every bucket (no limit on copies in flight); keeping starts once the receivers staged. On a
    # device the copies themselves start only when collected (the publisher collects once the version is live).
    copies = out.host_copies = host_copies_for(group, keep, deadline, defer_keep=True, defer_copy=True)
    export = Export(pack_stream(named_tensors, bucket_mb, group.device, plan=plan, sender=sender, alloc=alloc), out)
    kept: list[Any] = []
    try:
        buckets = list(export)
        t = time.perf_counter()
        records = []
        for bucket in buckets:  # no digests in the record: one fingerprint is compared at the commit
            handle, keep_it = ipc_export(bucket, None if group._ring is None else group._ring.exports)
            kept.append(keep_it)
            records.append({"handle": handle, "nbytes": bucket.nbytes, "table": encode_table(bucket)})
        if group.device.type == "cuda":  # the bytes are complete before anyone reads them (the checksums need not be)
            torch.cuda.current_stream(group.device).synchronize()
        store.set(_key(group, "b0"), pickle.dumps({"kind": WHOLE, "buckets": records}))
        out.seconds["broadcast"] += time.perf_counter() - t
        # the checksums run while the receivers stage (one pass where the buckets share the ring's arena); the
        # host copies start once the digests are out
        hash_whole_lazy(buckets, verify, out)()
        t = time.perf_counter()
        for bucket in buckets:
            group._ring_copies.append(copies.add(bucket))
        out.seconds["host_copy"] += time.perf_counter() - t
        buckets.clear()
        t = time.perf_counter()
        _wait_acks(group, 0, deadline)
        out.seconds["broadcast"] += time.perf_counter() - t
        copies.finish()
    except BaseException as err:
        _abort_send(group, copies, "b0", [_key(group, w) for w in ("b0", "a0")])
        _raise_send_failure(group, err, export)
    finally:
        for keep_it in kept:  # shared files: the receivers' mappings outlive the unlink
            _ipc_free(keep_it)
    group._leftover += [_key(group, w) for w in ("b0", "a0")]
    return out


def ipc_receive_stream(group: CollectiveGroup, deadline: float) -> Iterator[Bucket]:
    """The receiver's side of one push: every bucket at once, staged as views of the sender's buffers (the same
    record as the last push's: the buckets opened then); acknowledged once the consumer staged the last one."""
    if group.broken or group._store is None:
        raise CollectiveError(f"group {group.spec.group_id} is broken (an earlier step failed); form a new one")
    store = group._store
    group._pushes += 1
    k = 0
    try:
        key = _key(group, "b0")
        store.wait([key], datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        raw = store.get(key)
        cached = group._opened.get("whole")
        if cached is not None and cached[0] == raw:  # the same buffers, tables and handles as the last push
            opened = cached[1]
        else:
            record = pickle.loads(raw)
            if record["kind"] == ABORT:  # the sender knows; this group stays usable for the next push
                raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push")
            if record["kind"] != WHOLE:
                raise CollectiveError(f"group {group.spec.group_id}: unknown ipc record kind {record['kind']!r}")
            # All opened before the first is staged: a sender that aborts (another receiver failed) frees its
            # buffers, and a mapping taken before that outlives it.
            opened = []
            try:
                for part in record["buckets"]:
                    metas, rank = decode_table(part["table"])
                    opened.append(ipc_open(part["handle"], metas, int(part["nbytes"]), group.device, group._opened,
                                           rank, copy=False))
            except Exception:
                if store.check([_key(group, "aborted")]):  # freed by the sender's abort, not broken
                    raise SenderAborted(f"group {group.spec.group_id}: the sender aborted this push") from None
                raise
        for k, bucket in enumerate(opened):
            yield bucket
        store.add(_key(group, "a0"), 1)  # the consumer staged the last one
        if group.device.type == "cuda":  # (views of buffers the sender keeps: valid while they are)
            group._opened["whole"] = (raw, opened)
    except SenderAborted:
        raise
    except Exception as err:
        raise _failed(group, err, report=f"{type(err).__name__}: {err}") from err
    except BaseException:  # the consumer stopped reading mid-push (its staging failed) or was interrupted
        _failed(group, CollectiveError(f"stopped reading at bucket {k}"), report=f"stopped reading at bucket {k}")
        raise


def ipc_refuse(group: CollectiveGroup, why: str) -> None:
    """This receiver will not take the coming push (its begin was refused): tell the sender now,
    as a receiver that failed, instead of letting it wait for acknowledgements to its deadline.
    The group is broken on both sides; the next push forms a new one."""
    if group.broken or group._store is None:
        return
    group._pushes += 1  # the key of the push the sender is (or will be) publishing
    _failed(group, CollectiveError(why), report=f"refused: {why}")
