"""Fingerprints: the digest both sides of a weight push agree on before anything is applied.

Owns: the four verify modes, per-tensor digests (`tensor_digests` for loose tensors,
`bucket_digests` for a packed bucket in one pass over it) and their combination into a version's
fingerprint (`combine_digests`, `tensor_fingerprint`).

Fingerprints are two-level: a sha256 digest per tensor (its name, dtype, shape and, by mode, its
bytes), then a sha256 over the sorted (name, digest) pairs, so arrival order and bucketing do not
matter and each side hashes a bucket as it passes. A push in the engine's layout (plan.py) hashes
the engine's parameters as packed (names prefixed with the engine rank when there are several);
a push in the Hugging Face layout hashes the HF tensors. The mode is part of the fingerprint
("full:<hex>"):
  full     every byte of every tensor (sha256)
  sampled  tensors up to 128 KiB whole, larger ones in 32 evenly spaced 4 KiB windows plus their
           length, each piece as its checksum (below), computed where the bytes are (one pass for
           all pieces: no bytes leave a GPU): catches a wrong, truncated, reordered or shifted
           tensor at ~1/100 of the reads, not a flipped byte between windows
  checksum every byte, as the 64-bit position-weighted sum of checksum.py, computed where the bytes
           are (one kernel per bucket on a GPU, 8 bytes per tensor to host; numpy on host memory):
           any single changed word changes it; for transport errors, not for an adversary
  off      names, dtypes and shapes only (a missing, extra or reshaped tensor still fails)

Must never: talk to an engine or a transport, or decide when a version is committed.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from asyncrl.weightsync.checksum import resolve, segment_checksums_lazy

NamedTensors = Mapping[str, Any] | Iterable[tuple[str, Any]]
VerifyMode = Literal["full", "sampled", "checksum", "off"]
VERIFY_MODES: tuple[str, ...] = ("full", "sampled", "checksum", "off")
SAMPLE_WINDOW = 4096
SAMPLE_WINDOWS = 32


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


def _head(name: str, dtype: Any, shape: Any) -> Any:
    """A fresh sha256 fed the tensor's name, dtype and shape (what every mode hashes first)."""
    return _head_state(name, str(dtype), tuple(shape)).copy()


@functools.lru_cache(maxsize=1 << 16)
def _head_state(name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    # A push hashes the same few hundred (name, dtype, shape) heads every time: kept, and copied.
    h = hashlib.sha256()
    h.update(name.encode() + b"\0" + dtype.encode() + b"\0" + repr(shape).encode() + b"\0")
    return h


def _windows(size: int) -> list[tuple[int, int]] | None:
    """The (start, length) byte windows `sampled` reads of a tensor of `size` bytes (None: all of it)."""
    if size <= SAMPLE_WINDOW * SAMPLE_WINDOWS:
        return None
    span = size - SAMPLE_WINDOW
    # starts on 8-byte boundaries: a device reads every window in the checksum kernel's one launch
    return [(span * i // (SAMPLE_WINDOWS - 1) // 8 * 8, SAMPLE_WINDOW) for i in range(SAMPLE_WINDOWS)]


def _digests(flat: Any, entries: list[tuple[str, str, tuple[int, ...], int, int]], mode: VerifyMode) -> dict[str, bytes]:
    """Digests of tensors laid out in one flat uint8 buffer (numpy or torch, any device):
    entries are (key, dtype name, shape, byte offset, byte length). What a mode reads of a device
    buffer comes to host in one copy (checksum: 8 bytes per tensor)."""
    return _digests_lazy(flat, entries, mode)()


def _digests_lazy(flat: Any, entries: list[tuple[str, str, tuple[int, ...], int, int]],
                  mode: VerifyMode) -> Callable[[], dict[str, bytes]]:
    """`_digests`, with a device buffer's reads only enqueued: the returned call waits for them
    (so a sender can enqueue every bucket's and wait once)."""
    heads = {key: _head(key, dtype, shape) for key, dtype, shape, _, _ in entries}
    if mode == "off":
        return lambda: {k: h.digest() for k, h in heads.items()}
    if mode == "checksum":
        pending = segment_checksums_lazy(flat, [(o, n) for _, _, _, o, n in entries])

        def checksums() -> dict[str, bytes]:
            for (key, _, _, _, n), value in zip(entries, resolve(pending)):
                heads[key].update(int(n).to_bytes(8, "little") + int(value).to_bytes(8, "little"))
            return {k: h.digest() for k, h in heads.items()}

        return checksums
    pieces: list[tuple[str, int, int]] = []
    for key, _, _, offset, nbytes in entries:
        windows = _windows(nbytes) if mode == "sampled" else None
        if windows is None:
            pieces.append((key, offset, nbytes))
        else:
            heads[key].update(int(nbytes).to_bytes(8, "little"))
            pieces.extend((key, offset + s, n) for s, n in windows)
    if mode == "sampled":  # each piece's checksum, read where the bytes are (one pass for all of them)
        sums = segment_checksums_lazy(flat, [(o, n) for _, o, n in pieces])

        def sampled() -> dict[str, bytes]:
            # (length, checksum) of every piece as little-endian u64 pairs, one update per tensor
            words = np.empty((len(pieces), 2), dtype="<u8")
            words[:, 0] = [n for _, _, n in pieces]
            words[:, 1] = np.array(resolve(sums), dtype=np.uint64) if pieces else []
            raw = words.tobytes()
            start = 0
            for i in range(1, len(pieces) + 1):
                if i == len(pieces) or pieces[i][0] != pieces[start][0]:
                    heads[pieces[start][0]].update(raw[16 * start : 16 * i])
                    start = i
            return {k: h.digest() for k, h in heads.items()}

        return sampled
    if isinstance(flat, torch.Tensor) and flat.device.type != "cpu":
        parts = [flat[o : o + n] for _, o, n in pieces]
        gathered = torch.cat(parts) if parts else None  # enqueued; read to host when finished

        def hashed() -> dict[str, bytes]:
            host = gathered.cpu().numpy() if gathered is not None else np.empty(0, dtype=np.uint8)
            at = 0
            for key, _, n in pieces:
                heads[key].update(memoryview(host[at : at + n]))
                at += n
            return {k: h.digest() for k, h in heads.items()}

        return hashed
    array = flat.numpy() if isinstance(flat, torch.Tensor) else flat
    for key, o, n in pieces:
        heads[key].update(memoryview(array[o : o + n]))
    digests = {k: h.digest() for k, h in heads.items()}
    return lambda: digests


def _as_flat(t: torch.Tensor) -> Any:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.numpy() if flat.device.type == "cpu" else flat


def tensor_digests(pairs: Iterable[tuple[str, Any]], mode: VerifyMode = "full") -> dict[str, bytes]:
    """sha256 of each (name, tensor)'s name, dtype, shape and (by `mode`) bytes."""
    check_verify_mode(mode)
    out: dict[str, bytes] = {}
    for name, tensor in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        t = tensor.detach() if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu" else contiguous_tensor(tensor)
        flat = _as_flat(t)
        size = int(flat.size if isinstance(flat, np.ndarray) else flat.numel())
        out.update(_digests(flat, [(name, str(t.dtype), tuple(t.shape), 0, size)], mode))
    return out


def tensor_digest(name: str, tensor: Any, mode: VerifyMode = "full") -> bytes:
    return tensor_digests([(name, tensor)], mode)[name]


def bucket_digests(bucket: Any, mode: VerifyMode = "full", prefix: str = "") -> dict[str, bytes]:
    """Digests of every tensor packed in `bucket` (bucket.py), read where its buffer is, one pass
    (equal to `tensor_digests` of its unpacked tensors, with `prefix` before each name)."""
    return bucket_digests_lazy(bucket, mode, prefix)()


def bucket_digests_lazy(bucket: Any, mode: VerifyMode = "full", prefix: str = "") -> Callable[[], dict[str, bytes]]:
    """`bucket_digests` whose device reads are enqueued now and waited for by the returned call."""
    check_verify_mode(mode)
    buffer = bucket.buffer
    if isinstance(buffer, torch.Tensor):
        flat = buffer.reshape(-1).view(torch.uint8)
        flat = flat.numpy() if flat.device.type == "cpu" else flat
    else:
        flat = np.asarray(buffer).reshape(-1).view(np.uint8)
    entries = [(prefix + m.name, "torch." + m.dtype, tuple(m.shape), m.offset, m.nbytes) for m in bucket.metas]
    return _digests_lazy(flat, entries, mode)


def buckets_digests_lazy(buckets: Sequence[tuple[Any, str]], mode: VerifyMode = "full") -> Callable[[], dict[str, bytes]]:
    """`bucket_digests_lazy` of several (bucket, prefix) pairs, merged. Where every bucket is a
    contiguous torch view of one storage (an ipc sender's arena, and a receiver's mapping of it)
    they are read in one pass over it: on a device, one kernel launch and one copy to host."""
    check_verify_mode(mode)
    bufs = [b.buffer for b, _ in buckets]
    shared = bool(bufs) and all(isinstance(x, torch.Tensor) and x.is_contiguous() and x.dtype == torch.uint8 for x in bufs) \
        and len({(x.device, x.untyped_storage().data_ptr()) for x in bufs}) == 1
    if not shared:
        finishes = [bucket_digests_lazy(b, mode, prefix) for b, prefix in buckets]
        return lambda: {k: v for f in finishes for k, v in f().items()}
    storage = bufs[0].untyped_storage()
    flat: Any = torch.empty(0, dtype=torch.uint8, device=bufs[0].device).set_(storage, 0, (storage.nbytes(),))
    if flat.device.type == "cpu":
        flat = flat.numpy()
    entries = [(prefix + m.name, "torch." + m.dtype, tuple(m.shape), b.buffer.storage_offset() + m.offset, m.nbytes)
               for b, prefix in buckets for m in b.metas]
    return _digests_lazy(flat, entries, mode)


def combine_digests(digests: Mapping[str, bytes], mode: VerifyMode = "full") -> str:
    """The fingerprint of a set of tensors from their digests (any arrival order)."""
    check_verify_mode(mode)
    h = hashlib.sha256()
    for name in sorted(digests):
        h.update(name.encode() + b"\0" + digests[name])
    return f"{mode}:{h.hexdigest()}"


def tensor_fingerprint(named_tensors: NamedTensors, mode: VerifyMode = "full") -> str:
    """The fingerprint of a set of tensors; arrival order does not matter.

    Duplicate names are an error: the digest would otherwise depend on which copy wins.
    """
    check_verify_mode(mode)
    pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup}")
    return combine_digests(tensor_digests(pairs, mode), mode)
