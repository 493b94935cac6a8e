"""Bucketing: a stream of (name, tensor) packed into flat byte buckets, and unpacked back to views.

Owns: `Bucket` (one contiguous uint8 buffer + its tensor table: one object to move, one `ray.put`, one file, one
broadcast), the lazy packer (`iter_buckets`), the zero-copy unpacker (`unpack_bucket`), and a gloo / NCCL sender's
whole planned version in one arena (`whole_arena`) or a ring of reused slots (`SenderRing`). Must never: hold more
than the bucket being filled plus the one being emitted (tensors are pulled lazily: peak extra memory is one or two
buckets, not the model), talk to a channel or know about versions. Details: docs/design/weightsync.md, "Bucketing"."""

from __future__ import annotations

import math
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


def digest_key_prefix(bucket: Bucket) -> str:
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


def metas_from_wire(metas: Iterable[Any]) -> list[TensorMeta]:
    """A tensor table as it came off a wire (a list of lists: msgpack and JSON keep no tuples)."""
    return [TensorMeta(n, d, tuple(s), int(o), int(b)) for n, d, s, o, b in metas]


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
