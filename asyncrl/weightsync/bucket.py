"""Bucketing: a stream of (name, tensor) packed into flat byte buckets, and unpacked back to views.

Owns: `Bucket` (one contiguous uint8 buffer + its tensor table: one object to move, one `ray.put`, one file, one
broadcast), the lazy packer (`iter_buckets`), the zero-copy unpacker (`unpack_bucket`), the same bucket as a
shared-memory file (`SharedBucket`: how a replica hands a bucket to its vLLM workers, whose msgpack `collective_rpc`
copied every bucket several times, and what the shm transport puts), and where a gloo / NCCL sender packs a whole
planned version: one arena (`whole_arena`) or a ring of reused slots (`SenderRing`).
Must never: hold more than the bucket being filled plus the one being emitted (tensors are pulled lazily: peak extra
memory is one or two buckets, not the model), talk to a transport, or know about versions.
Details: docs/design/weightsync.md, "Bucketing"."""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import tempfile
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from asyncrl.weightsync.fingerprint import contiguous_tensor

# Every tensor starts on a 64-byte boundary: `view(dtype)` needs the byte offset to be a
# multiple of the element size, and 64 also keeps each tensor on its own cache line.
ALIGN = 64


def _align(n: int, align: int = ALIGN) -> int:
    return (int(n) + align - 1) // align * align


def windows(sizes: Iterable[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Where buffers of `sizes` start as `align`-aligned windows of one allocation, in order, and its bytes."""
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += _align(n, align)
    return offsets, total


class TensorMeta(NamedTuple):
    """Where one tensor lives inside a bucket buffer; a plain tuple on every wire (pickle, msgpack, JSON)."""

    name: str  # engine-layout (HF) parameter name
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # byte offset into Bucket.buffer (a multiple of ALIGN)
    nbytes: int  # numel * element size (0 for empty tensors)


@dataclass(slots=True, eq=False)  # equality of numpy buffers is ambiguous: identity
class Bucket:
    """A group of tensors flattened into one byte buffer: a numpy uint8 array, which Ray's pickle-5 path moves out
    of band (a replica reading it from the object store maps it read-only, no copy); inside a collective push, a
    uint8 tensor on the sender's or receiver's device, which never leaves its process."""

    buffer: np.ndarray
    metas: list[TensorMeta] = field(default_factory=list)
    rank: int | None = None  # engine rank of an engine-layout bucket (plan.py); None: Hugging Face tensors

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    @property
    def payload_bytes(self) -> int:
        """Tensor bytes, without alignment padding."""
        return sum(m.nbytes for m in self.metas)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metas]

    def __len__(self) -> int:
        return len(self.metas)


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def digest_key_prefix(bucket: "Bucket | SharedBucket") -> str:
    """What a bucket's tensor names are prefixed with in a fingerprint: the engine rank for an
    engine-layout bucket (the same parameter name exists on every rank), nothing for HF tensors."""
    return "" if bucket.rank is None else f"{bucket.rank}/"


def pack_bucket(named: list[tuple[str, torch.Tensor]], device: torch.device | str | None = None,
                alloc: Callable[[int], torch.Tensor] | None = None) -> Bucket:
    """Flatten contiguous tensors into one buffer (one copy per tensor): numpy when `device` is None (CPU tensors),
    else a uint8 tensor on `device` (theirs), from `alloc(nbytes)` when given (a reused buffer)."""
    sizes = [t.numel() * t.element_size() for _, t in named]
    offsets, total = windows(sizes)
    metas = [TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), at, nbytes)
             for (name, t), at, nbytes in zip(named, offsets, sizes)]
    if device is None:
        buffer: Any = np.empty(total, dtype=np.uint8)
        flat = torch.from_numpy(buffer)
    else:
        buffer = flat = alloc(total) if alloc is not None else torch.empty(total, dtype=torch.uint8, device=device)
    for meta, (_, t) in zip(metas, named):
        if meta.nbytes:  # through uint8, so dtypes numpy lacks (bfloat16, float8) copy bit-exactly
            flat[meta.offset : meta.offset + meta.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return Bucket(buffer=buffer, metas=metas)


def iter_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_mb: float,
                 device: torch.device | str | None = None, alloc: Callable[[int], torch.Tensor] | None = None) -> Iterator[Bucket]:
    """Pack a (name, tensor) stream, in order, into buckets of at most `bucket_mb` MiB of tensor bytes (a larger
    tensor goes alone in its own). Duplicate names raise: the fingerprint would depend on which copy wins. With
    `device`, buffers are uint8 tensors there (a collective transport broadcasts them from there), else numpy."""
    cap = int(bucket_mb * (1 << 20))
    seen: set[str] = set()
    pending: list[tuple[str, torch.Tensor]] = []
    pending_bytes = 0
    for name, value in named_tensors:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the stream")
        seen.add(name)
        t = contiguous_tensor(value, device)
        size = _align(t.numel() * t.element_size())
        if pending and pending_bytes + size > cap:
            yield pack_bucket(pending, device, alloc)
            pending, pending_bytes = [], 0
        pending.append((name, t))
        pending_bytes += size
    if pending:
        yield pack_bucket(pending, device, alloc)


def unpack_bucket(bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into the bucket buffer: no copy. Read-only if the buffer is."""
    if isinstance(bucket.buffer, torch.Tensor):
        flat = bucket.buffer.view(torch.uint8).reshape(-1)
    else:
        with warnings.catch_warnings():
            # Buckets read from the object store are read-only mappings; the views are only read
            # (hashed or copied into the engine), never written.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(np.asarray(bucket.buffer).view(np.uint8).reshape(-1))
    out = []
    for m in bucket.metas:
        dtype = dtype_from_name(m.dtype)
        numel = math.prod(m.shape)
        if numel * dtype.itemsize != m.nbytes or m.offset + m.nbytes > flat.numel():
            raise ValueError(f"tensor {m.name!r}: metadata {m} does not fit a {flat.numel()}-byte bucket")
        if numel == 0:
            out.append((m.name, torch.empty(m.shape, dtype=dtype, device=flat.device)))
            continue
        out.append((m.name, flat[m.offset : m.offset + m.nbytes].view(dtype).reshape(m.shape)))
    return out


# ---- the same bucket as a shared-memory file ---------------------------------------------------

SHM_DIR = "/dev/shm"
FILE_PREFIX = "asyncrl-bucket-"


def metas_from_wire(metas: Iterable[Any]) -> list[TensorMeta]:
    """A tensor table as it came off a wire (a list of lists: msgpack and JSON keep no tuples)."""
    return [TensorMeta(n, d, tuple(s), int(o), int(b)) for n, d, s, o, b in metas]


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


FREE = ".free"  # a bucket file released (`SharedBucket.recycle`): any packer on the host may write it again
_MAPPED: dict[str, tuple[mmap.mmap, np.ndarray]] = {}  # the bucket files this process packed, mapped writable


class SharedAllocator:
    """Buffers that are shared files from the start: a packer writes a bucket straight into its file, and
    `write_shared` of that bucket copies nothing (it adopts the file). A released file of the same size is written
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


def write_shared(bucket: Bucket, allocator: SharedAllocator | None = None) -> SharedBucket:
    """A shared file holding `bucket` (the caller unlinks it): the one `allocator` packed it into, else a new copy."""
    adopted = allocator.adopt(bucket) if allocator is not None else None
    if adopted is not None:
        return adopted
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


# ---- where a gloo / NCCL sender packs a whole planned version (stream.py's `broadcast_send_stream`) ----------

def whole_arena(planned: list[Any], device: torch.device) -> Callable[[Any], torch.Tensor]:
    """One allocation for a sender's whole planned version, each bucket a 64-byte-aligned window by plan index, so
    the buckets hash in one pass (one kernel launch, not one a bucket); no more memory than separate buffers, which a
    push keeps until its broadcasts end. Raises torch.OutOfMemoryError where the device cannot hold it (a ring then)."""
    starts, total = windows(b.nbytes for b in planned)
    offsets = {b.index: at for b, at in zip(planned, starts)}
    arena = torch.empty(total, dtype=torch.uint8, device=device)
    return lambda b: arena.narrow(0, offsets[b.index], b.nbytes)


RING_SLOTS = 4  # a ring's least slots: buckets on the wire or being copied to the host while the next is packed


class SenderRing:
    """A whole planned version sent through a few reused slots, for a sender whose device cannot hold it beside its
    own state (receivers see the same table and buckets). `buffer(planned bucket)` (the packer's `planned_buffer`)
    hands out a free slot; with none free it waits, on the host and by the deadline, for the oldest sent bucket's
    broadcast and host copy (its checksums ran on the packing stream before the next bucket). `sent(plan index,
    broadcasts, host copy)` hands a packed bucket's slot to the wire. `max(RING_SLOTS, the packer's most open buckets
    + 2)` slots, so a bucket being packed never waits for one behind it; an export opening more at once (another
    order than the plan's) gets one more slot rather than a wait that could not end."""

    def __init__(self, planned: list[Any], device: torch.device, deadline: float, *, open_at_once: int = 1) -> None:
        size = max((b.nbytes for b in planned), default=0)
        count = max(RING_SLOTS, open_at_once + 2)
        starts, total = windows([size] * count)
        arena = torch.empty(total, dtype=torch.uint8, device=device)
        self._slots = [arena.narrow(0, at, size) for at in starts]
        self._size, self._device, self.deadline = size, device, deadline
        self._free = list(range(count - 1, -1, -1))
        self._open: dict[int, int] = {}  # plan index -> slot, being packed
        self._flight: deque[tuple[int, Any, Any]] = deque()  # (slot, Broadcasts, host copy), sent
        self.waited = 0.0  # seconds the packer waited for a slot (the wire or the host copies behind)

    def buffer(self, b: Any) -> torch.Tensor:
        if not self._free and not self._flight:  # every slot holds a bucket still being packed: one more slot
            self._slots.append(torch.empty(self._size, dtype=torch.uint8, device=self._device))
            self._free.append(len(self._slots) - 1)
        if not self._free:
            t = time.perf_counter()
            slot, sending, copy = self._flight.popleft()
            if sending is not None:  # (None: an empty bucket, nothing on the wire)
                sending.wait()
            copy.wait(self.deadline)
            self.waited += time.perf_counter() - t
            self._free.append(slot)
        slot = self._free.pop()
        self._open[b.index] = slot
        return self._slots[slot].narrow(0, 0, b.nbytes)

    def sent(self, index: int, sending: Any, copy: Any) -> None:
        self._flight.append((self._open.pop(index), sending, copy))
