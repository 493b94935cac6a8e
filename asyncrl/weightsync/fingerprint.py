"""Fingerprints: the digest both sides of a weight push agree on before anything is applied.

Owns: the three verify modes, per-tensor digests (`tensor_digests` for loose tensors, `bucket_digests` for a packed
bucket in one pass) and their combination into a version's fingerprint (`combine_digests`, `tensor_fingerprint`).
How: a sha256 digest per tensor (name, dtype, shape and, by mode, its bytes), then a sha256 over the sorted
(name, digest) pairs, so arrival order and bucketing do not matter; the mode is part of it ("full:<hex>"). Modes:
`full` (sha256 of every byte), `checksum` (checksum.py's sum of every byte, computed where the bytes are: against
transport errors, not an adversary), `off` (names, dtypes and shapes only: a missing, extra or reshaped tensor still
fails). An engine-layout push (plan.py) hashes the engine's parameters as packed, a Hugging Face push the HF tensors.
Must never: talk to an engine or a transport, or decide when a version is committed.
Details: docs/design/weightsync.md, "Fingerprints".
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from asyncrl.weightsync.checksum import Pending, resolve, segment_checksums_lazy

NamedTensors = Mapping[str, Any] | Iterable[tuple[str, Any]]
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


def _head(name: str, dtype: Any, shape: Any) -> Any:
    """A fresh sha256 fed the tensor's name, dtype and shape (what every mode hashes first)."""
    return _head_state(name, str(dtype), tuple(shape)).copy()


@functools.lru_cache(maxsize=1 << 16)
def _head_state(name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    # A push hashes the same few hundred (name, dtype, shape) heads every time: kept, and copied.
    h = hashlib.sha256()
    h.update(name.encode() + b"\0" + dtype.encode() + b"\0" + repr(shape).encode() + b"\0")
    return h


def _digests(flat: Any, entries: list["Entry"], mode: VerifyMode) -> dict[str, bytes]:
    """Digests of tensors laid out in one flat uint8 buffer (numpy or torch, any device):
    entries are (key, dtype name, shape, byte offset, byte length). What a mode reads of a device
    buffer comes to host in one copy (checksum: 8 bytes per tensor)."""
    return _digests_lazy(flat, entries, mode)()


Entry = tuple[str, str, tuple[int, ...], int, int]  # (key, dtype name, shape, byte offset, byte length)


def meta_entries(metas: Iterable[Any], prefix: str = "", base: int = 0) -> list[Entry]:
    """The entries of a bucket's tensor table (`TensorMeta`s, offsets from `base` in the buffer hashed),
    each name behind `prefix`."""
    return [(prefix + m.name, "torch." + m.dtype, tuple(m.shape), base + m.offset, m.nbytes) for m in metas]


def _checksum_digests(entries: Sequence[Entry], words: np.ndarray) -> dict[str, bytes]:
    """The `checksum` digests of `entries` from their checksums (one unsigned 64-bit word a tensor, in order)."""
    if words.size != len(entries):
        raise ValueError(f"{words.size} checksums for {len(entries)} tensors")
    heads = {key: _head(key, dtype, shape) for key, dtype, shape, _, _ in entries}
    for (key, _, _, _, n), value in zip(entries, words.tolist()):  # (length, sum) per tensor
        heads[key].update(int(n).to_bytes(8, "little") + int(value).to_bytes(8, "little"))
    return {k: h.digest() for k, h in heads.items()}


class PendingDigests:
    """The digests of some tensors in one mode, their device reads enqueued: calling it waits for
    them and returns the digests. `checksum` comes as `words` (a checksum a tensor, in order), still
    on the device as `device_words` where it was computed there (so that several reach the host in
    one copy, `merge`); `full` and `off` as `digests`."""

    def __init__(self, entries: Sequence[Entry], mode: VerifyMode, *, words: Callable[[], Any] | None = None,
                 digests: Callable[[], dict[str, bytes]] | None = None, device_words: torch.Tensor | None = None) -> None:
        if (words is None) == (digests is None):
            raise ValueError("PendingDigests takes one source: words (checksum) or digests (full, off)")
        self.entries, self.mode, self.device_words = list(entries), mode, device_words
        self._words_fn, self._digests_fn = words, digests
        self._words: np.ndarray | None = None
        self._digests: dict[str, bytes] | None = None

    def words(self) -> np.ndarray:
        """The checksums (`checksum` mode only), one word a tensor in order."""
        if self._words_fn is None:
            raise ValueError(f"{self.mode!r} digests come whole, not as checksums")
        if self._words is None:
            self._words = np.asarray(self._words_fn(), dtype=np.uint64).reshape(-1)
        return self._words

    def __call__(self) -> dict[str, bytes]:
        if self._digests is None:
            self._digests = self._digests_fn() if self._digests_fn is not None \
                else _checksum_digests(self.entries, self.words())
        return self._digests

    @staticmethod
    def merge(parts: Sequence["PendingDigests"]) -> "PendingDigests":
        """One result of several (in order); where every part is still on the device, it is too, and
        reaches the host in one copy."""
        if not parts:
            raise ValueError("nothing to merge")
        mode = parts[0].mode
        if any(p.mode != mode for p in parts):
            raise ValueError("PendingDigests of different modes")
        entries = [e for p in parts for e in p.entries]
        device = [p.device_words for p in parts]
        if all(d is not None for d in device):  # one copy to host for all of them
            on_device = torch.cat(device)  # type: ignore[arg-type]
            return PendingDigests(entries, mode, words=lambda: on_device.cpu().numpy().view(np.uint64), device_words=on_device)
        return PendingDigests(entries, mode, digests=lambda: {k: v for p in parts for k, v in p().items()})


def _digests_lazy(flat: Any, entries: list[Entry], mode: VerifyMode) -> PendingDigests:
    """`_digests`, with a device buffer's reads only enqueued: the returned call waits for them
    (so a sender can enqueue every bucket's and wait once)."""
    if mode == "off":
        return PendingDigests(entries, mode, digests=lambda: {k: _head(k, d, s).digest() for k, d, s, _, _ in entries})
    if mode == "checksum":  # each tensor's checksum, read where the bytes are (one pass for all)
        pending = segment_checksums_lazy(flat, [(o, n) for _, _, _, o, n in entries])
        on_device = pending.values if isinstance(pending, Pending) and not any(pending.extra) else None
        return PendingDigests(entries, mode, words=lambda: np.array(resolve(pending), dtype=np.uint64),
                              device_words=on_device)
    heads = {key: _head(key, dtype, shape) for key, dtype, shape, _, _ in entries}
    if isinstance(flat, torch.Tensor) and flat.device.type != "cpu":
        parts = [flat[o : o + n] for _, _, _, o, n in entries]
        gathered = torch.cat(parts) if parts else None  # enqueued; read to host when finished

        def hashed() -> dict[str, bytes]:
            host = gathered.cpu().numpy() if gathered is not None else np.empty(0, dtype=np.uint8)
            at = 0
            for key, _, _, _, n in entries:
                heads[key].update(memoryview(host[at : at + n]))
                at += n
            return {k: h.digest() for k, h in heads.items()}

        return PendingDigests(entries, mode, digests=hashed)
    array = flat.numpy() if isinstance(flat, torch.Tensor) else flat
    for key, _, _, o, n in entries:
        heads[key].update(memoryview(array[o : o + n]))
    digests = {k: h.digest() for k, h in heads.items()}
    return PendingDigests(entries, mode, digests=lambda: digests)


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


def bucket_digests(bucket: Any, mode: VerifyMode = "full", prefix: str = "") -> dict[str, bytes]:
    """Digests of every tensor packed in `bucket` (bucket.py), read where its buffer is, one pass
    (equal to `tensor_digests` of its unpacked tensors, with `prefix` before each name)."""
    return bucket_digests_lazy(bucket, mode, prefix)()


def bucket_digests_lazy(bucket: Any, mode: VerifyMode = "full", prefix: str = "") -> PendingDigests:
    """`bucket_digests` whose device reads are enqueued now and waited for by the returned call."""
    check_verify_mode(mode)
    buffer = bucket.buffer
    if isinstance(buffer, torch.Tensor):
        flat = buffer.reshape(-1).view(torch.uint8)
        flat = flat.numpy() if flat.device.type == "cpu" else flat
    else:
        flat = np.asarray(buffer).reshape(-1).view(np.uint8)
    entries = meta_entries(bucket.metas, prefix)
    return _digests_lazy(flat, entries, mode)


def buckets_digests_lazy(buckets: Sequence[tuple[Any, str]], mode: VerifyMode = "full") -> PendingDigests:
    """`bucket_digests_lazy` of several (bucket, prefix) pairs, merged. Where every bucket is a
    contiguous torch view of one storage (an ipc sender's arena, and a receiver's mapping of it)
    they are read in one pass over it: on a device, one kernel launch and one copy to host."""
    check_verify_mode(mode)
    bufs = [b.buffer for b, _ in buckets]
    shared = bool(bufs) and all(isinstance(x, torch.Tensor) and x.is_contiguous() and x.dtype == torch.uint8 for x in bufs) \
        and len({(x.device, x.untyped_storage().data_ptr()) for x in bufs}) == 1
    if not buckets:
        return PendingDigests([], mode, digests=dict)
    if not shared:
        return PendingDigests.merge([bucket_digests_lazy(b, mode, prefix) for b, prefix in buckets])
    storage = bufs[0].untyped_storage()
    flat: Any = torch.empty(0, dtype=torch.uint8, device=bufs[0].device).set_(storage, 0, (storage.nbytes(),))
    if flat.device.type == "cpu":
        flat = flat.numpy()
    entries = [e for b, prefix in buckets for e in meta_entries(b.metas, prefix, b.buffer.storage_offset())]
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
