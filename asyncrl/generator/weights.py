"""Weight payloads as the generator sees them: fingerprints, wire packing, and the `WeightStore`.

Owns: `tensor_fingerprint` (the digest both sides of a weight push agree on; weightsync reuses
it), the byte packing used to hand tensors to vLLM workers through `collective_rpc`, and
`WeightStore`, a tiny named Ray actor that remembers the latest committed weights so a replica
that starts late (autoscaling, restart) can load them before it reports healthy.

Must never: talk to an engine, or decide when a version is committed (weightsync owns that;
it only calls `WeightStore.publish` after every live replica committed).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

NamedTensors = Mapping[str, Any] | Iterable[tuple[str, Any]]

# One packed tensor on the wire: (name, dtype name, shape, raw bytes). Plain msgpack-able types,
# because vLLM's utility channel decodes arguments without type hints (tensors would arrive as
# opaque tuples).
PackedTensor = tuple[str, str, list[int], bytes]


def as_cpu_tensor(value: Any) -> torch.Tensor:
    """A contiguous CPU torch tensor from a torch tensor or numpy array."""
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
    return value.detach().to("cpu").contiguous()


def _items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    pairs = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out = []
    for name, value in pairs:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        out.append((name, as_cpu_tensor(value)))
    return out


def _raw_bytes(t: torch.Tensor) -> bytes:
    # Through uint8 so that dtypes numpy lacks (bfloat16) hash and pack the same way.
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_fingerprint(named_tensors: NamedTensors) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order.

    Duplicate names are an error: the digest would otherwise depend on which copy wins.
    """
    items = _items(named_tensors)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup}")
    h = hashlib.sha256()
    for name, t in sorted(items, key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(b"\0" + str(t.dtype).encode() + b"\0")
        h.update(repr(tuple(t.shape)).encode() + b"\0")
        h.update(_raw_bytes(t))
    return h.hexdigest()


def pack_tensors(named_tensors: NamedTensors) -> list[PackedTensor]:
    return [(name, str(t.dtype).removeprefix("torch."), list(t.shape), _raw_bytes(t)) for name, t in _items(named_tensors)]


def unpack_tensors(packed: Iterable[PackedTensor]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, dtype_name, shape, raw in packed:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype_name!r}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        expected = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if flat.numel() != expected:
            raise ValueError(f"tensor {name!r}: {flat.numel()} bytes for shape {shape} {dtype_name}")
        out.append((name, flat.view(dtype).reshape(shape)))
    return out


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
    """Holds the latest committed (version, CPU tensors, fingerprint). Run as a named Ray actor.

    Interface (kept small on purpose; weightsync may replace the class but keeps these methods):
      publish(version, named_tensors, fingerprint) -> None   # version must increase; fingerprint checked
      latest() -> (version, named_tensors | None, fingerprint)  # (0, None, "") before any publish
      version() -> int
    """

    def __init__(self) -> None:
        self._version = 0
        self._tensors: dict[str, torch.Tensor] | None = None
        self._fingerprint = ""

    def publish(self, version: int, named_tensors: NamedTensors, fingerprint: str) -> None:
        if not isinstance(version, int) or version <= self._version:
            raise ValueError(f"version={version!r} must be an int greater than the stored {self._version}")
        tensors = dict(_items(named_tensors))
        actual = tensor_fingerprint(tensors)
        if actual != fingerprint:
            raise ValueError(f"fingerprint mismatch for version {version}: given {fingerprint[:12]}, tensors hash to {actual[:12]}")
        self._version, self._tensors, self._fingerprint = version, tensors, fingerprint

    def latest(self) -> tuple[int, dict[str, torch.Tensor] | None, str]:
        return self._version, self._tensors, self._fingerprint

    def version(self) -> int:
        return self._version
