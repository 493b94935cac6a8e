"""Masked reductions shared by the advantage estimators and the losses.

Owns: how a [B, T] tensor is reduced over its valid (mask != 0) entries, and the one constant
that bounds log-ratios before they are exponentiated.

Must never: import anything beyond torch, hold state, or let a masked-out entry (padding, which
may hold garbage such as -inf log-probs) reach a result or a gradient. Masked-out entries are
removed with `torch.where`, never by multiplying by the mask, because `inf * 0 = nan`.
"""

from __future__ import annotations

import torch
from torch import Tensor

# exp(20) ~ 4.9e8 fits float32 with room for products of two such factors; exp(1000) does not.
LOG_RATIO_CLAMP = 20.0


def as_bool_mask(mask: Tensor) -> Tensor:
    """Return `mask != 0` as a bool tensor (a bool mask is returned as is)."""
    return mask if mask.dtype == torch.bool else mask != 0


def safe_exp_diff(a: Tensor, b: Tensor) -> Tensor:
    """exp(clamp(a - b, -20, 20)): a ratio of probabilities from log-probs that cannot overflow."""
    return torch.exp(torch.clamp(a - b, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_{i: m_i} v_i over all entries (dim=None) or along `dim`."""
    kept = torch.where(as_bool_mask(mask), values, 0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """sum_{i: m_i} v_i / max(#{i: m_i}, 1) over all entries (dim=None) or along `dim`.

    A reduction with no valid entries is 0, never nan.
    """
    m = as_bool_mask(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(values, m, dim) / count.clamp(min=1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(v - mu) / sqrt(var + eps) on valid entries, 0 elsewhere.

    mu and var are the masked mean and the unbiased (n - 1) masked variance over *all* valid
    entries of the tensor (the whole batch, not per row). With fewer than two valid entries the
    variance is taken as 0, so a single valid entry whitens to 0.
    """
    m = as_bool_mask(mask)
    mean = masked_mean(values, m)
    centered = torch.where(m, values - mean, 0)
    var = centered.square().sum() / (m.sum() - 1).clamp(min=1)
    return torch.where(m, centered * torch.rsqrt(var + eps), 0)
