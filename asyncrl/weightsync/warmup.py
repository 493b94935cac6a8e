"""Load every kernel a push launches on a GPU before the push's broadcasts are enqueued.

Why: CUDA loads a kernel's module at its first launch (lazy loading, and every Triton kernel), and that load waits for
the device's queued work to drain: inside a push, the group's NCCL broadcasts. A receiver's first checksum kernel
would wait for the whole wire, and under a shard plan that wait closes a circle (worker, sender 0, learner rank 1):
a push that never finishes. Launching each kernel once on a few bytes when the groups form (`CollectiveGroup.join`,
no broadcast queued yet) takes that load off the push. What is warmed, once per process and device: the checksum
kernel at both alignments Triton specializes on, through the calls a push makes; the copy, concatenation and fused
copy kernels in the parameter dtypes; the index / fill kernels around them.
Owns: `warm_push_kernels`. Must never: run inside a push (it synchronizes the device), or change any state a push
reads (it works on scratch tensors only).
Details: docs/design/weightsync.md, "Kernel warmup".
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch

from asyncrl.weightsync.bucket import Bucket, pack_bucket
from asyncrl.weightsync.fingerprint import bucket_digests_lazy, buckets_digests_lazy

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VERIFY_MODES = ("checksum", "full")

_lock = threading.Lock()
_warmed: set[tuple[str, tuple[torch.dtype, ...]]] = set()


def _scratch(dtypes: tuple[torch.dtype, ...], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """A few small tensors of each dtype, sized so that a bucket of them has a short last word."""
    out = []
    for dtype in dtypes:
        for n in (3, 67):
            out.append((f"warm.{dtype}.{n}".replace("torch.", ""), torch.ones(n, dtype=dtype, device=device)))
    return out


def warm_push_kernels(device: torch.device | str | None, dtypes: tuple[torch.dtype, ...] = DTYPES) -> list[str]:
    """Launch once, on scratch tensors of `device`, every kernel a push launches there, then wait
    for them. Returns what it ran ([] when this process warmed that device for these dtypes already,
    or on a device other than CUDA, whose kernels need no loading)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return []
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    key = (str(dev), tuple(dtypes))
    with _lock:
        if key in _warmed:
            return []
        ran = _warm(dev, tuple(dtypes))
        torch.cuda.synchronize(dev)
        _warmed.add(key)
    return ran


def _warm(dev: torch.device, dtypes: tuple[torch.dtype, ...]) -> list[str]:
    ran: list[str] = []
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():  # (the host: the same calls, for tests)
        named = _scratch(dtypes, dev)
        bucket = pack_bucket(named, dev)  # the packer's byte copies
        ran.append("pack")
        # the same bytes 8 bytes into a larger buffer: Triton compiles a kernel per 16-byte alignment of its pointers
        shifted = torch.zeros(bucket.nbytes + 64, dtype=torch.uint8, device=dev)
        shifted[8 : 8 + bucket.nbytes].copy_(bucket.buffer)
        moved = Bucket(buffer=shifted.narrow(0, 8, bucket.nbytes), metas=bucket.metas)
        for mode in VERIFY_MODES:
            for b in (bucket, moved):
                bucket_digests_lazy(b, mode)()  # type: ignore[arg-type]
            # a whole version's one pass over buckets that share a storage (sender and receiver alike)
            parts = [Bucket(buffer=shifted.narrow(0, 0, 64), metas=[]), moved]
            buckets_digests_lazy([(b, f"r{i}/") for i, b in enumerate(parts)], mode)()  # type: ignore[arg-type]
            ran.append(f"digests:{mode}")
        for dtype in dtypes:  # the apply's fused copies into live weights, the export's cat and slices
            src = [torch.ones(n, dtype=dtype, device=dev) for n in (5, 129)]
            dst = [torch.empty_like(t) for t in src]
            torch._foreach_copy_(dst, src)
            torch.cat(src).narrow(0, 1, 64).contiguous()
            ran.append(f"copy:{str(dtype).removeprefix('torch.')}")
        words = torch.zeros(16, dtype=torch.int64, device=dev)  # the checksums' and the headers' int64 work
        torch.cat([words, words]).fill_(0)
        ran.append("int64")
    return ran


def warmed() -> list[tuple[str, tuple[Any, ...]]]:
    """(device, dtypes) pairs warmed in this process."""
    return sorted(_warmed, key=str)
