"""Weight payloads as the generator sees them: fingerprints and the `WeightStore`.

Owns: `tensor_fingerprint` (the digest both sides of a weight push agree on; weightsync reuses
it) in its four verify modes, and `WeightStore`, a tiny named Ray actor that remembers the
latest committed weights so a replica that starts late (autoscaling, restart) can load them
before it reports healthy.

Fingerprints are two-level: a sha256 digest per tensor (name, dtype, shape and, by mode, its
bytes), then a sha256 over the sorted (name, digest) pairs. Per-tensor digests let each side
hash a bucket as it passes (the publisher after handing it out, the worker as it stages it), so
verification costs no extra pass at commit. The mode is part of the fingerprint ("full:<hex>"):
  full     every byte of every tensor
  sampled  tensors up to 128 KiB whole, larger ones in 32 evenly spaced 4 KiB windows plus their
           length: catches a wrong, truncated, reordered or shifted tensor at ~1/100 of the cost,
           not a flipped byte between windows
  checksum every byte, as a 64-bit position-weighted sum computed where the tensor lives (on a GPU
           at memory bandwidth; only 8 bytes per tensor come to host): sum_i w_i * m_i mod 2^64
           over the tensor's 32-bit words (16- or 8-bit when its size is not a multiple of 4),
           m_i odd and pseudo-random per position. Any change to a single word changes it (odd
           m_i); other corruptions go unseen with probability ~2^-64 unless crafted. For
           transport errors, not for an adversary
  off      names, dtypes and shapes only (a missing, extra or reshaped tensor still fails)

Must never: talk to an engine, or decide when a version is committed (weightsync owns that;
it only calls `WeightStore.publish` after every live replica committed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np
import torch

NamedTensors = Mapping[str, Any] | Iterable[tuple[str, Any]]
VerifyMode = Literal["full", "sampled", "checksum", "off"]
VERIFY_MODES: tuple[str, ...] = ("full", "sampled", "checksum", "off")
SAMPLE_WINDOW = 4096
SAMPLE_WINDOWS = 32
CHECKSUM_CHUNK = 1 << 20  # words per step: bounds the int64 temporaries (8 MiB each)
_WORD = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def contiguous_tensor(value: Any, device: torch.device | str | None = None) -> torch.Tensor:
    """A contiguous torch tensor from a torch tensor or numpy array, on CPU (or `device`)."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    return value.detach().to(device or "cpu").contiguous()


def _items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out = []
    for name, value in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        out.append((name, contiguous_tensor(value)))
    return out


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


def tensor_digest(name: str, tensor: Any, mode: VerifyMode = "full") -> bytes:
    """sha256 of one tensor's name, dtype, shape and (by `mode`) bytes.

    A tensor on an accelerator is copied to host only as far as `mode` reads it: nothing for
    `off`, its sampled windows for `sampled` (cut on the device), all of it for `full`."""
    return tensor_digests([(name, tensor)], mode)[name]


def tensor_digests(pairs: Iterable[tuple[str, Any]], mode: VerifyMode = "full") -> dict[str, bytes]:
    """`tensor_digest` of every (name, tensor); what `mode` reads of the device tensors among them
    comes to host in one copy (one synchronisation for a bucket, not one per tensor)."""
    check_verify_mode(mode)
    heads: dict[str, Any] = {}
    parts: dict[str, list[Any]] = {}
    for name, tensor in pairs:
        t = tensor.detach() if isinstance(tensor, torch.Tensor) and tensor.device.type != "cpu" else contiguous_tensor(tensor)
        h = heads[name] = hashlib.sha256()
        h.update(name.encode() + b"\0" + str(t.dtype).encode() + b"\0" + repr(tuple(t.shape)).encode() + b"\0")
        if mode == "off":
            continue
        flat = t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        size = int(flat.numel())
        if mode == "checksum":
            h.update(size.to_bytes(8, "little"))
            parts[name] = [_checksum(flat).view(torch.uint8)]  # 8 bytes, on the tensor's device
            continue
        if mode == "full" or size <= SAMPLE_WINDOW * SAMPLE_WINDOWS:
            parts[name] = [flat]
            continue
        h.update(size.to_bytes(8, "little"))
        span = size - SAMPLE_WINDOW
        starts = [span * i // (SAMPLE_WINDOWS - 1) for i in range(SAMPLE_WINDOWS)]
        parts[name] = [flat[s : s + SAMPLE_WINDOW] for s in starts]
    host = _to_host([p for ps in parts.values() for p in ps])
    for name, ps in parts.items():
        for p in ps:
            heads[name].update(host[id(p)])
    return {name: h.digest() for name, h in heads.items()}


_MULTIPLIERS: dict[torch.device, torch.Tensor] = {}


def _multipliers(device: torch.device) -> torch.Tensor:
    """The odd per-position multipliers of one chunk (splitmix64-style mix of the position),
    made once per device; int64 arithmetic wraps the same way on every device."""
    m = _MULTIPLIERS.get(device)
    if m is None:
        x = torch.arange(CHECKSUM_CHUNK, dtype=torch.int64) * -7046029254386353131  # 0x9E3779B97F4A7C15
        x = x ^ (x >> 31)
        x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9
        x = x ^ (x >> 27)
        m = _MULTIPLIERS[device] = (x | 1).to(device)
    return m


def _checksum(flat: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * m_i (mod 2^64) over the 32/16/8-bit words of `flat` (uint8), as a 1-element int64
    tensor on its device; chunk c's sum is scaled by an odd constant of c, so moving whole chunks shows."""
    size = int(flat.numel())
    width = 4 if size % 4 == 0 else (2 if size % 2 == 0 else 1)
    if flat.storage_offset() % width:  # a view at an unaligned byte offset: read its words from a copy
        flat = flat.clone()
    words = flat.view(_WORD[width])
    m = _multipliers(flat.device)
    total = torch.zeros(1, dtype=torch.int64, device=flat.device)
    for c, a in enumerate(range(0, int(words.numel()), CHECKSUM_CHUNK)):
        w = words[a : a + CHECKSUM_CHUNK]
        s = (w.to(torch.int64) * m[: w.numel()]).sum()
        total += s * (2 * c + 1) if c else s
    return total


def _to_host(pieces: list[torch.Tensor]) -> dict[int, np.ndarray]:
    """Each uint8 piece as numpy, by id; the pieces on one device come over in a single copy."""
    out = {id(p): p.numpy() for p in pieces if p.device.type == "cpu"}
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in pieces:
        if p.device.type != "cpu":
            by_device.setdefault(p.device, []).append(p)
    for group in by_device.values():
        joined = torch.cat(group).cpu().numpy()
        offset = 0
        for p in group:
            out[id(p)] = joined[offset : offset + p.numel()]
            offset += p.numel()
    return out


def combine_digests(digests: Mapping[str, bytes], mode: VerifyMode = "full") -> str:
    """The fingerprint of a set of tensors from their `tensor_digest`s (any arrival order)."""
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
    items = _items(named_tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup}")
    return combine_digests({name: tensor_digest(name, t, mode) for name, t in items}, mode)


def load_hf_tensors(model_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF safetensors checkpoint directory (for tests, benchmarks, seeding a store)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


class WeightStore:
    """Holds the latest committed (version, buckets, fingerprint). Run as a named Ray actor.

    The weights are kept as weightsync `Bucket`s: Ray moves their numpy buffers out of band (a
    list of torch tensors costs ~0.2 s to pickle even for the 3.3 MB demo model, measured), and a
    late replica stages them as they are.

    Interface (kept small on purpose; weightsync may replace the class but keeps these methods):
      publish(version, buckets | named_tensors, fingerprint) -> None   # version must increase; fingerprint checked
      latest() -> (version, buckets | None, fingerprint)  # (0, None, "") before any publish
      version() -> int
    """

    BUCKET_MB = 256.0

    def __init__(self) -> None:
        self._version = 0
        self._buckets: list[Any] | None = None
        self._fingerprint = ""

    def publish(self, version: int, weights: Any, fingerprint: str) -> None:
        from asyncrl.weightsync.bucket import Bucket, iter_buckets, iter_unpacked

        if not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version={version!r} must be an int greater than the stored {self._version}")
        weights = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        if all(isinstance(b, Bucket) for b in weights):
            buckets = weights
        else:
            buckets = list(iter_buckets(weights, self.BUCKET_MB))  # checks names, brings tensors to CPU
        actual = tensor_fingerprint(iter_unpacked(buckets), fingerprint_mode(fingerprint))
        if actual != fingerprint:
            raise ValueError(f"fingerprint mismatch for version {version}: given {fingerprint[:24]}, tensors hash to {actual[:24]}")
        self._version, self._buckets, self._fingerprint = version, buckets, fingerprint

    def latest(self) -> tuple[int, list[Any] | None, str]:
        return self._version, self._buckets, self._fingerprint

    def version(self) -> int:
        return self._version
