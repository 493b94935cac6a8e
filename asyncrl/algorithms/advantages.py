"""Advantage estimators: rewards (and values) in, per-sequence or per-token advantages out.

Owns: GRPO / Dr. GRPO, RLOO, REINFORCE++ and GAE advantages, and placing a sequence's scalar
reward on its last response token.

Must never: start a process, import Megatron / Ray / an engine, or build a graph. Advantages and
returns are training *targets*: every function here runs under `torch.no_grad()` and returns
tensors without grad. Masked-out positions (mask == 0: prompt, padding, tool output) are 0 in
every per-token output and never influence a valid one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncrl.algorithms.utils import as_bool_mask, masked_whiten

__all__ = [
    "gae_advantages",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_rewards_from_sequence",
    "weight_negative_advantages",
]


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())


def _group_stats(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Return (d, inverse, counts): d = r - (max reward of r's group), per sequence.

    Shifting each group by one of its own members makes an all-equal group exactly 0 (a plain
    `r - mean` is off by rounding, which `/ (std + eps)` would then blow up to O(1e-2)), and keeps
    precision when rewards carry a large common offset.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    counts = torch.bincount(inverse, minlength=n_groups)
    shift = rewards.new_zeros(n_groups).scatter_reduce(0, inverse, rewards, reduce="amax", include_self=False)
    return rewards - shift[inverse], inverse, counts


def _group_sum(values: Tensor, inverse: Tensor, n_groups: int) -> Tensor:
    return values.new_zeros(n_groups).index_add_(0, inverse, values)


@torch.no_grad()
def grpo_advantages(rewards: Tensor, group_ids: Tensor, *, eps: float = 1e-6, scale_by_std: bool = True) -> Tensor:
    """Group-normalised advantage of each sequence (GRPO; Dr. GRPO with scale_by_std=False).

    A_i = (r_i - mean_g) / (std_g + eps)   with scale_by_std=True
    A_i =  r_i - mean_g                    with scale_by_std=False
    where g is i's group, mean_g its mean and std_g its unbiased (n_g - 1) standard deviation.
    A group of size 1 gets A = 0; a group whose rewards are all equal gets exactly 0.

    rewards: [N] one scalar per sequence. group_ids: [N] integers, any values, any order.
    Returns [N] in the rewards' float dtype.
    """
    r = _as_float(rewards)
    d, inverse, counts = _group_stats(r, group_ids)
    n = counts.to(r.dtype)
    centered = d - (_group_sum(d, inverse, len(counts)) / n)[inverse]
    if scale_by_std:
        var = _group_sum(centered.square(), inverse, len(counts)) / (n - 1).clamp(min=1)
        centered = centered / (var.sqrt()[inverse] + eps)
    return torch.where(counts[inverse] > 1, centered, 0)


@torch.no_grad()
def weight_negative_advantages(advantages: Tensor, weight: float) -> Tensor:
    """Scale the negative advantages by `weight` in [0, 1]; positive and zero ones are unchanged.

    1 is the estimator as it is. Below 1 the update pushes less on samples worse than their
    baseline: 0 keeps only the better-than-baseline ones (positive-advantage / filtered
    behaviour cloning), in between damps the "push down" half of the gradient, which can
    destabilise a small policy (the demo: docs/BENCHMARKS.md)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"negative advantage weight={weight} must lie in [0, 1]")
    if weight == 1.0:
        return advantages.detach().clone()
    return torch.where(advantages < 0, advantages * weight, advantages)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Leave-one-out advantage: A_i = r_i - (sum_{j in g, j != i} r_j) / (n_g - 1).

    A group of size 1 gets A = 0. rewards, group_ids: [N] as for `grpo_advantages`. Returns [N].
    """
    r = _as_float(rewards)
    d, inverse, counts = _group_stats(r, group_ids)
    others = (_group_sum(d, inverse, len(counts))[inverse] - d) / (counts[inverse] - 1).clamp(min=1)
    return torch.where(counts[inverse] > 1, d - others, 0)


@torch.no_grad()
def token_rewards_from_sequence(rewards: Tensor, mask: Tensor) -> Tensor:
    """Put each sequence's scalar reward on its last valid token: out[b, last_b] = r_b, else 0.

    last_b = max{t : mask[b, t] != 0}. A sequence with no valid token drops its reward (all 0).
    rewards: [B], mask: [B, T]. Returns [B, T] in the rewards' float dtype.
    """
    r = _as_float(rewards)
    m = as_bool_mask(mask)
    if m.shape[-1] == 0:
        return torch.zeros(m.shape, dtype=r.dtype, device=r.device)
    positions = torch.arange(1, m.shape[-1] + 1, device=m.device)
    last = (m * positions).argmax(dim=-1, keepdim=True)  # positions are distinct, so the max is the last valid one
    out = torch.zeros(m.shape, dtype=r.dtype, device=r.device).scatter_(-1, last, r[:, None])
    return torch.where(m, out, 0)


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """REINFORCE++: discounted reward-to-go per valid token, whitened over the batch's valid tokens.

    G_t = r_t + gamma * G_next(t), where next(t) is the next *valid* token of the same row
    (G = 0 past the last one). Masked-out positions neither add reward nor count as a discount
    step, so tool output inside a response does not shorten the horizon.
    A = masked_whiten(G, mask). token_rewards, mask: [B, T]. Returns [B, T], 0 where masked.
    """
    m = as_bool_mask(mask)
    r = _as_float(token_rewards)
    returns = torch.zeros_like(r)
    running = r.new_zeros(r.shape[0])
    # A loop over T, vectorised over B: cumsum with gamma**-t would overflow for long responses.
    for t in reversed(range(r.shape[-1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_whiten(torch.where(m, returns, 0), m)


@torch.no_grad()
def gae_advantages(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid response tokens.

    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lam * A_next(t)
    where next(t) is the next valid token of the same row; past the last valid token V = A = 0
    (masked-out positions are skipped, as in `reinforce_pp_advantages`).
    Returns (whitened A, returns) with returns = A + V computed from the *un-whitened* A; both
    [B, T] and 0 where masked.
    """
    m = as_bool_mask(mask)
    r = _as_float(token_rewards)
    v = torch.where(m, values.to(r.dtype), 0)
    advantages = torch.zeros_like(r)
    next_value = r.new_zeros(r.shape[0])
    next_adv = r.new_zeros(r.shape[0])
    for t in reversed(range(r.shape[-1])):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv_t, 0)
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, adv_t, next_adv)
    returns = torch.where(m, advantages + v, 0)
    return masked_whiten(advantages, m), returns
