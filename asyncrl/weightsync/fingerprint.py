"""Fingerprints: the digest both sides of a weight push agree on before anything is applied.

Owns: the three verify modes, per-tensor digests (`tensor_digests` for loose tensors, `bucket_digests` for a packed
bucket in one pass) and their combination into a version's fingerprint (`combine_digests`, `tensor_fingerprint`).
How: a sha256 digest per tensor (name, dtype, shape and, by mode, its bytes), then a sha256 over the sorted
(name, digest) pairs, so arrival order and bucketing do not matter; the mode is part of it ("full:<hex>"). Modes:
`full` (sha256 of every byte), `checksum` (a position-weighted 64-bit sum of every byte, `segment_checksums`: numpy
on the host, one Triton kernel on a device, equal bit for bit; against transport errors, not an adversary), `off`
(names, dtypes and shapes only). An engine-layout push hashes the engine's parameters as packed (plan.py).
Must never: talk to an engine or a transport, decide when a version is committed, or copy a device buffer to host to
check it in `checksum` or `off` mode. Details: docs/design/weightsync.md, "Fingerprints" and "The position-weighted checksum".
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

# ---- the position-weighted checksum (`verify: checksum`) ----------------------------------------------------

CH = 1 << 16  # words per chunk: the multiplier table (512 KiB) and the host's temporaries stay in cache
_MASK = (1 << 64) - 1
Segment = tuple[int, int]  # (byte offset, byte length) inside a buffer


def _table() -> np.ndarray:
    z = np.arange(CH, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


_HOST_TABLE = _table()


@functools.cache
def _device_table(device: torch.device) -> torch.Tensor:
    return torch.from_numpy(_HOST_TABLE.view(np.int64).copy()).to(device)


def _host_segment(flat: np.ndarray) -> int:
    """The checksum of a uint8 array."""
    n = int(flat.size)
    whole = n - n % 8
    words = flat[:whole].view(np.uint64) if flat.ctypes.data % 8 == 0 else flat[:whole].copy().view(np.uint64)
    total = 0
    tmp = np.empty(min(CH, max(1, int(words.size))), dtype=np.uint64)
    for c, a in enumerate(range(0, int(words.size), CH)):
        w = words[a : a + CH]
        k = int(w.size)
        np.multiply(w, _HOST_TABLE[:k], out=tmp[:k])
        total += int(tmp[:k].sum(dtype=np.uint64)) * (2 * c + 1)
    if whole != n:  # the last word, zero-padded, at word index whole // 8
        c, j = divmod(whole // 8, CH)
        total += int.from_bytes(flat[whole:].tobytes().ljust(8, b"\0"), "little") * int(_HOST_TABLE[j]) * (2 * c + 1)
    return total & _MASK


_BLOCK = 4096  # words per program
assert CH % _BLOCK == 0  # a program's block never straddles two chunks (the kernel relies on it)


@functools.cache  # (an ImportError is not kept: raised again at each call)
def _triton_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def segment_kernel(words, table, starts, firsts, counts, masks, partials, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
        # One program = one block of one segment: `starts` (its first word in the buffer), `firsts` (that
        # word's index within the segment), `counts` (valid words), `masks` (bytes of the segment's last word
        # that are its own, as a word mask). A block starts at a multiple of BLOCK within its segment and BLOCK
        # divides CHUNK, so the whole block lies in one chunk: its table entries are one contiguous slice and
        # its chunk factor (2 * chunk + 1) multiplies the block's sum once (mod 2^64 alike).
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

    return segment_kernel


@functools.lru_cache(maxsize=256)
def _programs(segments: tuple[Segment, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """The kernel's per-program table for these segments (kept: a plan's buckets repeat)."""
    starts, firsts, counts, masks, owner = [], [], [], [], []
    for s, (offset, nbytes) in enumerate(segments):
        nwords = (nbytes + 7) // 8
        rem = nbytes % 8
        for b in range(0, nwords, _BLOCK):
            count = min(_BLOCK, nwords - b)
            starts.append(offset // 8 + b)
            firsts.append(b)
            counts.append(count)
            masks.append((1 << (8 * rem)) - 1 if rem and b + count == nwords else -1)  # the last word's own bytes
            owner.append(s)
    as_i64 = lambda xs: torch.tensor(np.array(xs, dtype=np.uint64).view(np.int64), device=device)  # noqa: E731
    return as_i64(starts), as_i64(firsts), as_i64(counts), as_i64([m & _MASK for m in masks]), as_i64(owner)


def _cuda_segments(flat: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor | None:
    """Per-segment sums as an int64 tensor on the device, or None without Triton or 8-byte alignment."""
    try:
        kernel = _triton_kernel()
    except ImportError:
        return None
    if any(offset % 8 for offset, _ in segments) or flat.storage_offset() % 8 or flat.numel() % 8:
        return None
    starts, firsts, counts, masks, owner = _programs(tuple(segments), flat.device)
    out = torch.zeros(len(segments), dtype=torch.int64, device=flat.device)
    if starts.numel():
        partials = torch.empty(starts.numel(), dtype=torch.int64, device=flat.device)
        with torch.cuda.device(flat.device):
            kernel[(starts.numel(),)](flat.view(torch.int64), _device_table(flat.device), starts, firsts, counts, masks,
                                      partials, BLOCK=_BLOCK, CHUNK=CH)
        out.index_add_(0, owner, partials)  # int64 adds wrap mod 2^64
    return out


def _flat(buffer: Any) -> Any:
    """A buffer's bytes, flat: numpy in host memory, a uint8 tensor on a device."""
    if isinstance(buffer, torch.Tensor):
        flat = buffer.detach().reshape(-1).view(torch.uint8) if buffer.numel() else \
            torch.empty(0, dtype=torch.uint8, device=buffer.device)
        return flat.numpy() if flat.device.type == "cpu" else flat
    return np.asarray(buffer).reshape(-1).view(np.uint8)


def segment_checksums_lazy(buffer: Any, segments: Sequence[Segment]) -> Any:
    """Each segment's checksum: a list of ints for host memory, or (a CUDA buffer) an int64 tensor still being
    computed on the device (`segment_checksums` brings it to host in one copy). Elsewhere (no Triton, an unaligned
    view, another device) the bytes come to host first."""
    flat = _flat(buffer)
    for offset, nbytes in segments:
        if offset < 0 or nbytes < 0 or offset + nbytes > len(flat):
            raise ValueError(f"segment ({offset}, {nbytes}) outside a {len(flat)}-byte buffer")
    if isinstance(flat, torch.Tensor):
        fused = _cuda_segments(flat, segments) if flat.device.type == "cuda" else None
        if fused is not None:
            return fused
        flat = flat.cpu().numpy()
    return [_host_segment(flat[o : o + n]) for o, n in segments]


def segment_checksums(buffer: Any, segments: Sequence[Segment]) -> list[int]:
    sums = segment_checksums_lazy(buffer, segments)
    return [int(v) & _MASK for v in sums.cpu().tolist()] if isinstance(sums, torch.Tensor) else sums


VerifyMode = Literal["full", "checksum", "off"]
VERIFY_MODES: tuple[str, ...] = ("full", "checksum", "off")


def contiguous_tensor(value: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """A contiguous torch tensor from a torch tensor or numpy array, on CPU (or `device`)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    return value.detach().to(device or "cpu").contiguous()


def check_verify_mode(mode: str) -> VerifyMode:
    if mode not in VERIFY_MODES:
        raise ValueError(f"verify mode {mode!r} is not one of {list(VERIFY_MODES)}")
    return mode  # type: ignore[return-value]


def fingerprint_mode(fingerprint: str) -> VerifyMode:
    """The verify mode a fingerprint was computed with (its prefix)."""
    mode, sep, digest = str(fingerprint).partition(":")
    if not sep or not digest or mode not in VERIFY_MODES:
        raise ValueError(f"fingerprint {str(fingerprint)[:24]!r} is not '<mode>:<hex>' with mode in {list(VERIFY_MODES)}")
    return mode  # type: ignore[return-value]


@functools.lru_cache(maxsize=1 << 16)
def _head(name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    """A sha256 fed the tensor's name, dtype and shape (what every mode hashes first), kept (a push hashes the same
    few hundred heads every time): copy it before feeding it more."""
    h = hashlib.sha256()
    h.update(name.encode() + b"\0" + dtype.encode() + b"\0" + repr(shape).encode() + b"\0")
    return h


Entry = tuple[str, str, tuple[int, ...], int, int]  # (key, dtype name, shape, byte offset, byte length)


def meta_entries(metas: Iterable[Any], prefix: str = "", base: int = 0) -> list[Entry]:
    """The entries of a bucket's tensor table (`TensorMeta`s, offsets from `base` in the buffer hashed),
    each name behind `prefix`."""
    return [(prefix + m.name, "torch." + m.dtype, tuple(m.shape), base + m.offset, m.nbytes) for m in metas]


class PendingDigests:
    """The digests of some tensors in one mode, their device reads enqueued: calling it waits for them and returns
    the digests. `checksum` comes as `words` (a checksum a tensor, in order: the host's ints, or an int64 tensor
    still on the device, so that several reach the host in one copy, `merge`); `full` and `off` as `digests`."""

    def __init__(self, entries: Sequence[Entry], mode: VerifyMode, *, words: Any = None,
                 digests: Callable[[], dict[str, bytes]] | None = None) -> None:
        self.entries, self.mode, self._words, self._digests_fn = list(entries), mode, words, digests
        self.device_words = words if isinstance(words, torch.Tensor) else None
        self._digests: dict[str, bytes] | None = None

    def __call__(self) -> dict[str, bytes]:
        if self._digests is None and self._digests_fn is not None:
            self._digests = self._digests_fn()
        elif self._digests is None:
            words = self._words.cpu().numpy().view(np.uint64) if self.device_words is not None \
                else np.array(self._words, dtype=np.uint64)  # (one a tensor: segment_checksums_lazy of the entries)
            heads = {key: _head(key, dtype, shape).copy() for key, dtype, shape, _, _ in self.entries}
            for (key, _, _, _, n), value in zip(self.entries, words.tolist()):  # (length, sum) per tensor
                heads[key].update(int(n).to_bytes(8, "little") + int(value).to_bytes(8, "little"))
            self._digests = {k: h.digest() for k, h in heads.items()}
        return self._digests

    @staticmethod
    def merge(parts: Sequence["PendingDigests"]) -> "PendingDigests":
        """One result of several of one mode (in order); where every part is still on the device, it is too, and
        reaches the host in one copy."""
        entries, device = [e for p in parts for e in p.entries], [p.device_words for p in parts]
        if all(d is not None for d in device):  # one copy to host for all of them
            return PendingDigests(entries, parts[0].mode, words=torch.cat(device))  # type: ignore[arg-type]
        return PendingDigests(entries, parts[0].mode, digests=lambda: {k: v for p in parts for k, v in p().items()})


def _digests_lazy(flat: Any, entries: list[Entry], mode: VerifyMode) -> PendingDigests:
    """The digests of tensors laid out in one flat uint8 buffer (`_flat`), a device buffer's reads only enqueued:
    the returned call waits for them (so a sender can enqueue every bucket's and wait once)."""
    if mode == "off":
        return PendingDigests(entries, mode, digests=lambda: {k: _head(k, d, s).digest() for k, d, s, _, _ in entries})
    if mode == "checksum":  # each tensor's checksum, read where the bytes are (one pass for all)
        return PendingDigests(entries, mode, words=segment_checksums_lazy(flat, [(o, n) for _, _, _, o, n in entries]))
    heads = {key: _head(key, dtype, shape).copy() for key, dtype, shape, _, _ in entries}
    if isinstance(flat, torch.Tensor):  # `full` on a device (checksum is its fast mode) is hashed on the host: the
        host = flat.cpu().numpy()  # bytes copied now, so a later write into the buffer (a ring's slot) cannot reach them
        return PendingDigests(entries, mode, digests=lambda: _sha(host, entries, heads))
    digests = _sha(flat, entries, heads)
    return PendingDigests(entries, mode, digests=lambda: digests)


def _sha(array: np.ndarray, entries: list[Entry], heads: dict[str, Any]) -> dict[str, bytes]:
    for key, _, _, o, n in entries:
        heads[key].update(memoryview(array[o : o + n]))
    return {k: h.digest() for k, h in heads.items()}


def tensor_digests(pairs: Iterable[tuple[str, Any]], mode: VerifyMode = "full") -> dict[str, bytes]:
    """sha256 of each (name, tensor)'s name, dtype, shape and (by `mode`) bytes. Duplicate names are an error: the
    digest would otherwise depend on which copy wins."""
    check_verify_mode(mode)
    out: dict[str, bytes] = {}
    for name, tensor in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if name in out:
            raise ValueError(f"duplicate tensor names: [{name!r}]")
        t = contiguous_tensor(tensor, tensor.device if isinstance(tensor, torch.Tensor) else None)  # (where it is)
        flat = _flat(t)
        out.update(_digests_lazy(flat, [(name, str(t.dtype), tuple(t.shape), 0, len(flat))], mode)())
    return out


def bucket_digests(bucket: Any, mode: VerifyMode = "full", prefix: str = "") -> dict[str, bytes]:
    """Digests of every tensor packed in `bucket` (bucket.py), read where its buffer is, one pass
    (equal to `tensor_digests` of its unpacked tensors, with `prefix` before each name)."""
    return buckets_digests_lazy([(bucket, prefix)], mode)()


def buckets_digests_lazy(buckets: Sequence[tuple[Any, str]], mode: VerifyMode = "full") -> PendingDigests:
    """`bucket_digests` of several (bucket, prefix) pairs, merged, their device reads enqueued now and waited for by
    the returned call. Where they are contiguous torch views of one storage (an ipc sender's arena, and a receiver's
    mapping of it) they are read in one pass over it: on a device, one kernel launch and one copy to host."""
    check_verify_mode(mode)
    bufs = [b.buffer for b, _ in buckets]
    if len(bufs) > 1 and all(isinstance(x, torch.Tensor) and x.is_contiguous() and x.dtype == torch.uint8 for x in bufs) \
            and len({(x.device, x.untyped_storage().data_ptr()) for x in bufs}) == 1:
        storage = bufs[0].untyped_storage()
        flat = _flat(torch.empty(0, dtype=torch.uint8, device=bufs[0].device).set_(storage, 0, (storage.nbytes(),)))
        entries = [e for b, prefix in buckets for e in meta_entries(b.metas, prefix, b.buffer.storage_offset())]
        return _digests_lazy(flat, entries, mode)
    parts = [_digests_lazy(_flat(b.buffer), meta_entries(b.metas, prefix), mode) for b, prefix in buckets]
    return parts[0] if len(parts) == 1 else PendingDigests.merge(parts) if parts else PendingDigests([], mode, digests=dict)


def combine_digests(digests: Mapping[str, bytes], mode: VerifyMode = "full") -> str:
    """The fingerprint of a set of tensors from their digests (any arrival order), in a checked `mode`."""
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name])
    return f"{mode}:{h.hexdigest()}"


def tensor_fingerprint(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], mode: VerifyMode = "full") -> str:
    """The fingerprint of a set of tensors (`tensor_digests`); arrival order does not matter."""
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return combine_digests(tensor_digests(pairs, mode), mode)
