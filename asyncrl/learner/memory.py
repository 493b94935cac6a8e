"""A learner rank's memory: running out of device memory, recognised and reported; host memory given back.

Owns: which errors are the device running out of memory (torch's own, and NCCL failing to allocate, which is
how an exhausted device first shows inside a collective), and the message a user can act on: which verb and
rank, the largest micro-batch's tokens, the device's peak and size, and the settings that make it fit. And
`HostMemoryTrim`: the host memory a rank's freed tensors leave in the C library's heaps, given back when the
rank's resident set crept past its level after a step (glibc `malloc_trim`).
Must never: retry or shrink a batch by itself (a step must stay a function of its batch), or match any other
error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncrl.types import LearnerOutOfMemory

log = logging.getLogger(__name__)
GIB = float(2**30)
# What NCCL says when cudaMalloc / cudaCalloc fails inside a collective (torch wraps it as DistBackendError).
_NCCL_OOM_WORDS = ("Failed to CUDA calloc", "out of memory", "cudaErrorMemoryAllocation")
# Held outside a rank's allocator beyond this, its device is taken to be shared (a CUDA context, NCCL's buffers and the
# GEMM workspaces take one to three GiB of their own).
SHARED_DEVICE_BYTES = 4 * GIB


def is_out_of_memory(err: BaseException) -> bool:
    """torch's out-of-memory error, or NCCL's failed allocation inside a collective."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    backend = getattr(torch.distributed, "DistBackendError", None)
    return backend is not None and isinstance(err, backend) and any(w in str(err) for w in _NCCL_OOM_WORDS)


def micro_batch_tokens(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None, packed: bool) -> int:
    """The largest micro-batch's token count as the learner lays it out: padded rows (each as long as its longest
    sequence) or, packed, the sequences back to back."""
    from asyncrl.learner.batching import plan_micro_batches

    groups = plan_micro_batches(list(lengths), micro_batch_size, max_tokens) if lengths else []
    per = [sum(lengths[i] for i in g) if packed else len(g) * max(lengths[i] for i in g) for g in groups]
    return max(per, default=0)


def out_of_memory_error(verb: str, rank: int, lengths: Sequence[int], learner_cfg: Any,
                        peak_bytes: float | None, total_bytes: float | None,
                        elsewhere_bytes: float | None = None) -> LearnerOutOfMemory:
    """The report of an out-of-memory in `verb` of `rank` over sequences of `lengths` tokens; `elsewhere_bytes`: the
    device's memory held outside this rank's allocator (other processes, such as an engine beside it)."""
    cfg = learner_cfg
    tokens = micro_batch_tokens(lengths, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, cfg.sequence_packing)
    where = (f"peak {peak_bytes / GIB:.1f} GiB of {total_bytes / GIB:.1f} GiB on its device"
             if peak_bytes is not None and total_bytes else "device memory exhausted")
    recompute = cfg.strategy_config.get("recompute_granularity")
    fixes = []
    if elsewhere_bytes is not None and elsewhere_bytes >= SHARED_DEVICE_BYTES:
        where += f", {elsewhere_bytes / GIB:.1f} GiB of it held outside this rank (other processes)"
        fixes.append("the device to the learner while it trains, if an engine shares it: hybrid.enabled: true (or "
                     "auto; the engines sleep while the learner trains), or a smaller "
                     "generator.engine_kwargs.gpu_memory_utilization")
    if recompute != "full":
        fixes.append("recompute activations in the backward: learner.memory.recompute: full (Megatron's "
                     "recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1)")
    fixes.append(f"fewer tokens per micro-batch: learner.max_tokens_per_micro_batch (now "
                 f"{cfg.max_tokens_per_micro_batch}) with learner.sequence_packing: true, or a smaller "
                 f"learner.micro_batch_size (now {cfg.micro_batch_size})")
    fixes.append(f"a smaller learner.logprob_chunk_size (now {cfg.logprob_chunk_size}: tokens whose vocabulary-wide "
                 "logits exist at once)")
    if cfg.lora is not None and cfg.lora.hold_merged:
        fixes.append("no merged copy of the adapted weights during a pass: learner.lora.hold_merged: false")
    if cfg.memory.optimizer != "host" and total_bytes:
        fixes.append("Adam's moments on the host: learner.memory.optimizer: host (8 bytes a parameter off the device)")
    fixes.append("more ranks to shard over: tensor_model_parallel_size / context_parallel_size in learner.strategy_config")
    longest = max(lengths, default=0)
    message = (f"learner rank {rank} ran out of device memory in {verb}: {len(lengths)} sequences (longest {longest} "
               f"tokens), the largest micro-batch {tokens} tokens; {where}. To fit: " + "; ".join(fixes) + ".")
    return LearnerOutOfMemory(message, verb, rank, tokens)


def device_memory() -> tuple[float | None, float | None, float | None]:
    """(this process's peak allocated bytes, its device's size, the bytes of it neither free nor in this process's
    allocator: other processes' and this one's CUDA context) on CUDA; (None, None, None) elsewhere."""
    if not torch.cuda.is_available():
        return None, None, None
    free, total = torch.cuda.mem_get_info()
    return float(torch.cuda.max_memory_allocated()), float(total), float(total - free - torch.cuda.memory_reserved())


def resident_bytes() -> int | None:
    """This process's resident set now (Linux's /proc), None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def malloc_trim() -> bool:
    """glibc's `malloc_trim(0)`: free blocks of every heap go back to the system. False where the C
    library has none (musl, macOS)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(ctypes.c_size_t(0))
        return True
    except (OSError, AttributeError):
        return False


class HostMemoryTrim:
    """Called after each training step (by an engine replica, every `HOST_TRIM_EVERY_S`): gives freed host
    memory back once the resident set is more than `slack` above its level at the end of the first step since
    the last trim (the step's own working set, which the heaps keep on purpose: the next step reuses it
    without faulting its pages in again).
    Why: glibc keeps freed blocks, and once a step frees large buffers it raises its mmap threshold, so
    later steps allocate from its heaps too; the rank's resident set then creeps up step after step
    though nothing is kept. A trim after every step would make every step fault its working set in
    again; this trims about once per `slack` of creep."""

    def __init__(self, slack: float = 0.10, resident: Callable[[], int | None] = resident_bytes,
                 trim: Callable[[], bool] = malloc_trim) -> None:
        self.slack, self._resident, self._trim = slack, resident, trim
        self.level: int | None = None  # the resident set after the first step since the last trim
        self.trims = 0

    def after_step(self) -> bool:
        """Trim if the resident set crept past its level; whether it did."""
        now = self._resident()
        if now is None:
            return False
        if self.level is None:
            self.level = now
            return False
        if now <= self.level * (1 + self.slack) or not self._trim():
            return False
        self.trims += 1
        after = self._resident()
        log.info("host memory trimmed (%d so far): resident %.0f -> %s MB, level %.0f MB", self.trims,
                 now / 1e6, "?" if after is None else f"{after / 1e6:.0f}", self.level / 1e6)
        self.level = None  # (measured again after the next step: its working set, faulted in anew)
        return True
