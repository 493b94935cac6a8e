"""The shm channel: learner and replicas on one host, one shared file a bucket, mapped by every replica's workers.

Owns: `SharedBucket` (a `Bucket` in a file; also how a replica hands any bucket to its vLLM workers), the packers'
files (`SharedAllocator`, `write_shared`), `ShmChannel` (the publisher's side) and a learner rank's export into shm
files or object-store buckets (`pack_into_transport`). Must never: hand a packer a file someone may still read, or
look inside a bucket. Details: docs/design/weightsync.md, "The shm channel"."""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncrl.types import WeightExport
from asyncrl.weightsync.bucket import Bucket, TensorMeta, digest_key_prefix, metas_from_wire
from asyncrl.weightsync.fingerprint import bucket_digests
from asyncrl.weightsync.plan import pack_stream
from asyncrl.weightsync.transport import Channel

SHM_DIR, FILE_PREFIX = "/dev/shm", "asyncrl-bucket-"  # where bucket files go while there is room, and their names
FREE = ".free"  # a bucket file released (`SharedBucket.recycle`): any packer on the host may write it again
_MAPPED: dict[str, tuple[mmap.mmap, np.ndarray]] = {}  # the bucket files this process packed, mapped writable


def shared_dir(nbytes: int) -> str:
    """Where a shared file of `nbytes` goes: /dev/shm while it has room for it twice over
    (containers often mount a 64 MiB one), else the temp dir (page cache, still no disk wait)."""
    with contextlib.suppress(OSError):
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize >= 2 * nbytes:
            return SHM_DIR
    return tempfile.gettempdir()


@dataclass(frozen=True, slots=True)
class SharedBucket:
    """A `Bucket` whose buffer lives in a file (`path` None: no bytes). A recycled file may get the next version's
    bytes, which a reader's mapping then shows, so nothing reads one: the publisher recycles a version once another
    is live everywhere and the replicas' apply copied it (`verify` catches a reader that did)."""

    path: str | None
    metas: list[TensorMeta]
    nbytes: int
    rank: int | None = None

    def wire(self) -> tuple[str | None, list[TensorMeta], int | None]:
        return self.path, self.metas, self.rank

    @classmethod
    def from_wire(cls, path: str | None, metas: Iterable[Any], rank: int | None = None) -> "SharedBucket":
        return cls(path, metas_from_wire(metas), os.stat(path).st_size if path is not None else 0, rank)

    def open(self) -> Bucket:
        """Map the file copy-on-write: views read the shared pages, a write copies only its page. The mapping
        outlives the file's unlinking while a view of it is held."""
        if self.path is None:
            return Bucket(buffer=np.empty(0, dtype=np.uint8), metas=list(self.metas), rank=self.rank)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < self.nbytes:
                raise ValueError(f"shared bucket {self.path} has {size} bytes, expected {self.nbytes}")
            mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return Bucket(buffer=np.frombuffer(mapped, dtype=np.uint8), metas=list(self.metas), rank=self.rank)

    def unlink(self, suffix: str = "") -> None:
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)

    def recycle(self) -> None:
        """Nobody reads this file any more: a packer may write its next bucket of the same size into it."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path, self.path + FREE)


class SharedAllocator:
    """Buffers that are shared files from the start: a packer writes a bucket straight into its file, and
    `adopt` of that bucket copies nothing (it hands out the file). A released file of the same size is written
    again (claimed by renaming it back) through the mapping this process kept of it: a push then faults in no fresh
    pages (each costs a zeroing fault, and far more on a VM whose host takes freed guest memory back)."""

    def __init__(self) -> None:
        self._by_address: dict[int, str] = {}  # buffer handed out, not adopted yet
        self._free: dict[int, list[str]] = {}  # released files by size, listed once
        for path in [p for p in _MAPPED if not (os.path.exists(p) or os.path.exists(p + FREE))]:
            del _MAPPED[path]  # unlinked by their owner since: let their pages go
        for name in sorted(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else []:
            if name.startswith(FILE_PREFIX) and name.endswith(FREE):
                with contextlib.suppress(OSError):
                    path = os.path.join(SHM_DIR, name)
                    self._free.setdefault(os.stat(path).st_size, []).append(path)

    def __call__(self, nbytes: int) -> torch.Tensor:
        size, array = max(nbytes, 1), None
        while array is None and self._free.get(size):
            free = self._free[size].pop()
            path = free.removesuffix(FREE)
            with contextlib.suppress(OSError):
                os.rename(free, path)  # (another packer claimed it first: the next)
                array = self._map(path, size)
        if array is None:
            fd, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=shared_dir(nbytes))
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            _MAPPED.pop(path, None)  # (a name this process mapped once, unlinked since)
            array = self._map(path, size)
        self._by_address[array.ctypes.data] = path
        return torch.from_numpy(array[:nbytes])

    @staticmethod
    def _map(path: str, size: int) -> np.ndarray:
        if path not in _MAPPED:
            with open(path, "r+b") as f:
                mapped = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            _MAPPED[path] = (mapped, np.frombuffer(mapped, dtype=np.uint8))
        return _MAPPED[path][1]

    def adopt(self, bucket: Bucket) -> SharedBucket | None:
        """The shared file `bucket` was packed into, or None if it was not packed into one."""
        buffer = bucket.buffer
        address = buffer.data_ptr() if isinstance(buffer, torch.Tensor) else np.asarray(buffer).ctypes.data
        path = self._by_address.pop(address, None)
        return None if path is None else SharedBucket(path, list(bucket.metas), bucket.nbytes, bucket.rank)

    def discard(self) -> None:
        """Unlink every file handed out and not adopted (the allocator's owner is done with them)."""
        for path in self._by_address.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._by_address.clear()


def write_shared(bucket: Bucket) -> SharedBucket:
    """A new shared file holding a copy of `bucket` (the caller unlinks it)."""
    if bucket.nbytes == 0:
        return SharedBucket(None, list(bucket.metas), 0, bucket.rank)
    fd, path = tempfile.mkstemp(prefix=FILE_PREFIX, dir=shared_dir(bucket.nbytes))
    try:
        with os.fdopen(fd, "wb") as f:  # (a buffered write writes every byte; a large one bypasses the buffer)
            f.write(memoryview(np.ascontiguousarray(bucket.buffer).reshape(-1).view(np.uint8)))
    except BaseException:
        os.unlink(path)
        raise
    return SharedBucket(path, list(bucket.metas), bucket.nbytes, bucket.rank)


class ShmChannel(Channel):
    """It owns the bucket files, adopting one the learner ranks wrote when first read: `release` hands one back to the
    packers (`SharedBucket.recycle`: the next export writes into it again), one no export took by the export after
    is unlinked, and `close` (or the channel's collection, or process exit) unlinks every one it still holds."""

    name = "shm"

    def __init__(self) -> None:
        self._files: set[str] = set()
        self._recycled: set[str] = set()  # released since the last export was read
        self._finalizer = weakref.finalize(self, _unlink_all, self._files, self._recycled)

    def close(self) -> None:
        self._finalizer()

    def fetch(self, handle: SharedBucket) -> Bucket:
        if handle.path is not None and handle.path not in self._files:  # a new export's: the packers are done
            _unlink_all(set(), self._recycled)  # with the files released before it: one still free stays unused
            self._files.add(handle.path)
        return handle.open()

    def release(self, handle: SharedBucket) -> None:
        handle.recycle()
        self._files.discard(handle.path)
        if handle.path is not None:
            self._recycled.add(handle.path)


def _unlink_all(files: set[str], recycled: set[str]) -> None:
    """Every file a channel holds, and those it released that no packer took (a taken one is another's now)."""
    for paths, suffix in ((files, ""), (recycled, FREE)):
        for path in list(paths):
            SharedBucket(path, [], 0).unlink(suffix)
        paths.clear()


def pack_into_transport(tensors: Iterable[tuple[str, Any]], bucket_mb: float, transport: str, verify: str,
                        plan: Any = None, sender: int = 0) -> WeightExport:
    """Pack the stream into host buckets (engine layout with `plan`), each written straight into
    its shared file (shm) or put into the object store, and hash each as it is packed."""
    import ray

    if transport not in ("object_store", "shm"):
        raise ValueError(f"transport={transport!r}: learner ranks can put buckets into object_store or shm only")
    allocator = SharedAllocator() if transport == "shm" else None
    buckets = pack_stream(tensors, bucket_mb, torch.device("cpu"), plan=plan, sender=sender, alloc=allocator)
    handles, metas, digests = [], [], []
    seconds = {"pack": 0.0, "hash": 0.0, "put": 0.0}
    try:
        t = time.perf_counter()
        for bucket in buckets:
            seconds["pack"] += time.perf_counter() - t
            t = time.perf_counter()
            digests.append(bucket_digests(bucket, verify, digest_key_prefix(bucket)))  # type: ignore[arg-type]
            seconds["hash"] += time.perf_counter() - t
            t = time.perf_counter()
            metas.append(list(bucket.metas))
            if allocator is not None:  # (the file it was packed into; a copy only of a bucket packed elsewhere)
                handles.append(allocator.adopt(bucket) or write_shared(bucket))
            else:  # (numpy: Ray's pickle-5 path moves it out of band)
                handles.append(ray.put(Bucket(bucket.buffer.numpy(), list(bucket.metas), bucket.rank)))
            seconds["put"] += time.perf_counter() - t
            del bucket  # one packed bucket alive at a time in this heap
            t = time.perf_counter()
        seconds["pack"] += time.perf_counter() - t  # (the export's end)
    except BaseException:
        if allocator is not None:  # object-store refs free themselves when dropped
            allocator.discard()
            for h in handles:
                h.unlink()
        raise
    return WeightExport(buckets=handles, metas=metas, senders=[sender] * len(handles), digests=digests,
                        bytes=sum(m.nbytes for ms in metas for m in ms), num_tensors=sum(map(len, metas)),
                        num_buckets=len(handles), seconds=seconds)
