"""Gradient accumulation that equals the full-batch loss, whatever the micro-batching and DP split.

Owns: the denominator each aggregation mode divides by, and the factor that turns one micro-batch's `aggregate(...)`
into its exact share of the loss over the whole (all-DP) batch: share = aggregate_mb * D_mb / D, handed to Megatron
as `share * num_microbatches * dp_size` (it divides by the micro-batch count and DDP averages grads over DP).
Why: `aggregate` normalises by its own micro-batch, so a plain sum would weight micro-batches, not tokens/sequences.
Must never: compute a loss itself (asyncrl.algorithms does) or hold state.
Details: docs/design/learner.md, "Gradient accumulation".
"""

from __future__ import annotations

import torch

from asyncrl.algorithms.correction import Correction, correction_weights
from asyncrl.algorithms.losses import AggMode


def denominator(mask: torch.Tensor, mode: AggMode) -> float:
    """What `aggregate(values, mask, mode)` divides by, before its clamp to >= 1."""
    return float(denominator_tensor(mask, mode))


def denominator_tensor(mask: torch.Tensor, mode: AggMode) -> torch.Tensor:
    """`denominator` as a 0-d float32 tensor on the mask's device (no host synchronisation)."""
    m = mask != 0
    if mode == "token-mean":
        return m.sum().float()
    if mode == "seq-mean-token-sum-norm":
        return torch.tensor(float(m.numel()), device=m.device)
    return (m.sum(-1) > 0).sum().float()


def dp_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()


def dp_sum(values: list[float]) -> list[float]:
    """Sum floats over the data-parallel group of this rank (identity without DP)."""
    from megatron.core import parallel_state as ps

    from asyncrl.learner.parallel import collective_device

    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    if ps.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(t, group=ps.get_data_parallel_group())
    return t.tolist()


def dp_all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`t` summed ("sum") or maxed ("max") over the data-parallel group of this rank (identity without DP)."""
    from megatron.core import parallel_state as ps

    from asyncrl.learner.parallel import collective_device

    if ps.get_data_parallel_world_size() == 1:
        return t
    out = t.to(collective_device())
    reduce_op = {"sum": torch.distributed.ReduceOp.SUM, "max": torch.distributed.ReduceOp.MAX}[op]
    torch.distributed.all_reduce(out, op=reduce_op, group=ps.get_data_parallel_group())
    return out


def dp_mean(metrics: dict[str, float]) -> dict[str, float]:
    """Average a metric dict over the DP group (same keys on every rank)."""
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    if dp == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    return dict(zip(keys, (v / dp for v in dp_sum([metrics[k] for k in keys]))))


def from_last_stage(value: float) -> float:
    """`value` as the last pipeline stage holds it, on every stage of this rank's pipeline (only
    the last stage runs loss functions; identity without PP)."""
    from megatron.core import parallel_state as ps

    from asyncrl.learner.parallel import collective_device

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    torch.distributed.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return float(t.item())


def behavior_loss_mask(
    mask: torch.Tensor, old_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor | None, correction: Correction,
) -> torch.Tensor:
    """The policy loss's token mask: valid and not taken out by the rollout correction.

    The same function as `asyncrl.algorithms.losses`' (`correction_weights`), so denominators can be
    computed for the whole batch before any micro-batch runs.
    """
    if behavior_logprobs is None:
        return mask != 0
    return correction_weights(old_logprobs, behavior_logprobs, mask, correction)[1]
