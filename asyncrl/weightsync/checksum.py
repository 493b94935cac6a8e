"""The 64-bit position-weighted checksum of a byte range, the same number on host and device.

Owns: `segment_checksums(buffer, segments)`, the content check of `verify: checksum`. A segment (a tensor's bytes in
a bucket) is read as little-endian 64-bit words, each multiplied by an odd factor set by its position, summed mod
2^64: any single changed word changes the sum, moved words or chunks change their multipliers, and other corruptions
go unseen with probability about 2^-64 unless crafted (a check against transport and staging errors, not against an
adversary). A segment's checksum depends only on its own bytes. It runs as numpy on host memory, one Triton kernel
for all segments of a CUDA buffer, or a chunked torch fallback; host and device results are equal bit for bit, so a
bucket checked on a device on one side and in host memory on the other compares.
Must never: copy a device buffer to host to check it, or hold more than one chunk of host temporaries.
Details (the formula, each path's cost): docs/design/weightsync.md, "The position-weighted checksum".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

CH = 1 << 16  # words per chunk: the multiplier table (512 KiB) and the host's temporaries stay in cache
_MASK = (1 << 64) - 1
Segment = tuple[int, int]  # (byte offset, byte length) inside a buffer


def _table() -> np.ndarray:
    z = np.arange(CH, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z | np.uint64(1)


_HOST_TABLE = _table()
_DEVICE_TABLES: dict[torch.device, torch.Tensor] = {}


def _device_table(device: torch.device) -> torch.Tensor:
    table = _DEVICE_TABLES.get(device)
    if table is None:
        table = _DEVICE_TABLES[device] = torch.from_numpy(_HOST_TABLE.view(np.int64).copy()).to(device)
    return table


# ---- host --------------------------------------------------------------------------------------


def _host_words(flat: np.ndarray) -> int:
    """The checksum of a uint8 array whose length is a multiple of 8."""
    words = flat.view(np.uint64) if flat.ctypes.data % 8 == 0 else flat.copy().view(np.uint64)
    total = 0
    tmp = np.empty(min(CH, max(1, int(words.size))), dtype=np.uint64)
    for c, a in enumerate(range(0, int(words.size), CH)):
        w = words[a : a + CH]
        k = int(w.size)
        np.multiply(w, _HOST_TABLE[:k], out=tmp[:k])
        total += int(tmp[:k].sum(dtype=np.uint64)) * (2 * c + 1)
    return total & _MASK


def _tail_term(index: int, tail: bytes) -> int:
    """The term of a zero-padded last word at word `index`."""
    c, j = divmod(index, CH)
    return (int.from_bytes(tail.ljust(8, b"\0"), "little") * int(_HOST_TABLE[j]) * (2 * c + 1)) & _MASK


def _host_segment(flat: np.ndarray) -> int:
    n = int(flat.size)
    whole = n - n % 8
    value = _host_words(flat[:whole]) if whole else 0
    if whole != n:
        value = (value + _tail_term(whole // 8, flat[whole:].tobytes())) & _MASK
    return value


# ---- device ------------------------------------------------------------------------------------

_KERNEL: Any = None
_BLOCK = 4096  # words per program
assert CH % _BLOCK == 0  # a program's block never straddles two chunks (the kernel relies on it)


def _triton_kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def segment_kernel(words, table, starts, firsts, counts, masks, partials, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
            # One program = one block of one segment: `starts` (its first word in the buffer),
            # `firsts` (that word's index within the segment), `counts` (valid words), `masks`
            # (bytes of the segment's last word that are its own, as a word mask).
            # A block starts at a multiple of BLOCK within its segment and BLOCK divides CHUNK, so
            # the whole block lies in one chunk: its table entries are one contiguous slice and its
            # chunk factor (2 * chunk + 1) multiplies the block's sum once (mod 2^64 alike).
            pid = tl.program_id(0)
            start = tl.load(starts + pid)
            first = tl.load(firsts + pid)
            count = tl.load(counts + pid)
            last_mask = tl.load(masks + pid)
            lane = tl.arange(0, BLOCK).to(tl.int64)
            valid = lane < count
            w = tl.load(words + start + lane, mask=valid, other=0)
            w = tl.where(lane == count - 1, w & last_mask, w)
            m = tl.load(table + first % CHUNK + lane, mask=valid, other=0)
            tl.store(partials + pid, tl.sum(w * m, axis=0) * (2 * (first // CHUNK) + 1))

        _KERNEL = segment_kernel
    return _KERNEL


_PROGRAMS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _programs(segments: Sequence[Segment], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The kernel's per-program table for these segments (cached: a plan's buckets repeat)."""
    key = (tuple(segments), device)
    cached = _PROGRAMS.get(key)
    if cached is not None:
        return cached
    starts, firsts, counts, masks, owner = [], [], [], [], []
    for s, (offset, nbytes) in enumerate(segments):
        nwords = (nbytes + 7) // 8
        rem = nbytes % 8
        for b in range(0, nwords, _BLOCK):
            count = min(_BLOCK, nwords - b)
            starts.append(offset // 8 + b)
            firsts.append(b)
            counts.append(count)
            is_last = b + count == nwords
            masks.append(((1 << (8 * rem)) - 1) if (is_last and rem) else -1)
            owner.append(s)
    as_i64 = lambda xs: torch.tensor(np.array(xs, dtype=np.uint64).view(np.int64), device=device)  # noqa: E731
    tables = (as_i64(starts), as_i64(firsts), as_i64(counts), as_i64([m & _MASK for m in masks]), as_i64(owner))
    if len(_PROGRAMS) > 256:
        _PROGRAMS.clear()
    _PROGRAMS[key] = tables
    return tables


def _cuda_segments(flat: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor | None:
    """Per-segment sums as an int64 tensor on the device, or None where Triton is missing."""
    try:
        kernel = _triton_kernel()
    except ImportError:
        return None
    if any(offset % 8 for offset, _ in segments) or flat.storage_offset() % 8 or flat.numel() % 8:
        return None
    starts, firsts, counts, masks, owner = _programs(segments, flat.device)
    out = torch.zeros(len(segments), dtype=torch.int64, device=flat.device)
    if starts.numel():
        partials = torch.empty(starts.numel(), dtype=torch.int64, device=flat.device)
        with torch.cuda.device(flat.device):
            kernel[(starts.numel(),)](flat.view(torch.int64), _device_table(flat.device), starts, firsts, counts, masks,
                                      partials, BLOCK=_BLOCK, CHUNK=CH)
        out.index_add_(0, owner, partials)  # int64 adds wrap mod 2^64
    return out


def _torch_segment(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(device sum over the whole words, host term of the padded last word) for one segment."""
    n = int(flat.numel())
    whole = n - n % 8
    body = flat[:whole]
    if body.storage_offset() % 8:
        body = body.clone()
    words = body.view(torch.int64)
    table = _device_table(flat.device)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for c, a in enumerate(range(0, int(words.numel()), CH)):
        w = words[a : a + CH]
        total += (w * table[: w.numel()]).sum() * (2 * c + 1)
    tail = _tail_term(whole // 8, flat[whole:].cpu().numpy().tobytes()) if whole != n else 0
    return total, tail


# ---- entry points ------------------------------------------------------------------------------


def _flat(buffer: Any) -> Any:
    if isinstance(buffer, torch.Tensor):
        if buffer.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=buffer.device)
        flat = buffer.detach().reshape(-1).view(torch.uint8)
        return flat.numpy() if flat.device.type == "cpu" else flat
    return np.asarray(buffer).reshape(-1).view(np.uint8)


def segment_checksums_lazy(buffer: Any, segments: Sequence[Segment]) -> Any:
    """Each segment's checksum: a list of ints for host memory, or (for a device buffer) a
    `Pending` whose `result()` brings every segment's value to host in one copy."""
    flat = _flat(buffer)
    for offset, nbytes in segments:
        if offset < 0 or nbytes < 0 or offset + nbytes > (flat.numel() if isinstance(flat, torch.Tensor) else flat.size):
            raise ValueError(f"segment ({offset}, {nbytes}) outside a {flat.nbytes if hasattr(flat, 'nbytes') else flat.numel()}-byte buffer")
    if isinstance(flat, np.ndarray):
        return [_host_segment(flat[o : o + n]) for o, n in segments]
    fused = _cuda_segments(flat, segments) if flat.device.type == "cuda" else None
    if fused is not None:
        return Pending(fused, [0] * len(segments))
    parts = [_torch_segment(flat[o : o + n]) for o, n in segments]
    values = torch.stack([p[0] for p in parts]) if parts else torch.zeros(0, dtype=torch.int64, device=flat.device)
    return Pending(values, [p[1] for p in parts])


class Pending:
    """Device checksums still on the device (one int64 each), plus host terms to add."""

    def __init__(self, values: torch.Tensor, extra: list[int]) -> None:
        self.values, self.extra = values, extra

    def result(self) -> list[int]:
        host = self.values.cpu().tolist() if self.values.numel() else []
        return [(int(v) + e) & _MASK for v, e in zip(host, self.extra)]


def resolve(value: Any) -> list[int]:
    return value.result() if isinstance(value, Pending) else list(value)


def segment_checksums(buffer: Any, segments: Sequence[Segment]) -> list[int]:
    return resolve(segment_checksums_lazy(buffer, segments))


def checksum(buffer: Any) -> int:
    """The checksum of a whole buffer (one segment)."""
    flat = _flat(buffer)
    size = int(flat.numel() if isinstance(flat, torch.Tensor) else flat.size)
    return segment_checksums(flat, [(0, size)])[0]
