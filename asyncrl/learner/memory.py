"""Running out of device memory in a learner verb: recognised where it happens, reported as one typed error.

Owns: which errors are the device running out of memory (torch's own, and NCCL failing to allocate, which is
how an exhausted device first shows inside a collective), and the message a user can act on: which verb and
rank, the largest micro-batch's tokens, the device's peak and size, and the settings that make it fit.
Must never: retry or shrink a batch by itself (a step must stay a function of its batch), or match any other
error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncrl.types import LearnerOutOfMemory

GIB = float(2**30)
# What NCCL says when cudaMalloc / cudaCalloc fails inside a collective (torch wraps it as DistBackendError).
_NCCL_OOM_WORDS = ("Failed to CUDA calloc", "out of memory", "cudaErrorMemoryAllocation")


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
                        peak_bytes: float | None, total_bytes: float | None) -> LearnerOutOfMemory:
    """The report of an out-of-memory in `verb` of `rank` over sequences of `lengths` tokens."""
    cfg = learner_cfg
    tokens = micro_batch_tokens(lengths, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, cfg.sequence_packing)
    where = (f"peak {peak_bytes / GIB:.1f} GiB of {total_bytes / GIB:.1f} GiB on its device"
             if peak_bytes is not None and total_bytes else "device memory exhausted")
    recompute = cfg.strategy_config.get("recompute_granularity")
    fixes = []
    if recompute != "full":
        fixes.append("recompute activations in the backward: learner.memory.recompute: full (Megatron's "
                     "recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1)")
    fixes.append(f"fewer tokens per micro-batch: learner.max_tokens_per_micro_batch (now "
                 f"{cfg.max_tokens_per_micro_batch}) with learner.sequence_packing: true, or a smaller "
                 f"learner.micro_batch_size (now {cfg.micro_batch_size})")
    fixes.append(f"a smaller learner.logprob_chunk_size (now {cfg.logprob_chunk_size}: tokens whose vocabulary-wide "
                 "logits exist at once)")
    if cfg.memory.optimizer != "host" and total_bytes:
        fixes.append("Adam's moments on the host: learner.memory.optimizer: host (8 bytes a parameter off the device)")
    fixes.append("more ranks to shard over: tensor_model_parallel_size / context_parallel_size in learner.strategy_config")
    longest = max(lengths, default=0)
    message = (f"learner rank {rank} ran out of device memory in {verb}: {len(lengths)} sequences (longest {longest} "
               f"tokens), the largest micro-batch {tokens} tokens; {where}. To fit: " + "; ".join(fixes) + ".")
    return LearnerOutOfMemory(message, verb, rank, tokens)


def device_memory() -> tuple[float | None, float | None]:
    """(this process's peak allocated bytes, its device's size) on CUDA; (None, None) elsewhere."""
    if not torch.cuda.is_available():
        return None, None
    return float(torch.cuda.max_memory_allocated()), float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
