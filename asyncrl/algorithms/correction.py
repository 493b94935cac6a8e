"""Rollout correction: importance weights between the proximal policy and the engine that sampled.

Owns: the weight w = pi_prox / pi_behave (decoupled PPO) from d_t = old_t - behavior_t on valid tokens, at one of
three levels (token exp(d_t); sequence exp(sum d_t); geometric exp(mean d_t)), every log-ratio clamped to [-20, 20],
and its modes: mask (MIS, or IcePop's band with `lower`: tokens outside [lower, upper] leave the loss, the others
keep their weight), truncate (TIS: weights capped at `upper`, no token leaves) and `reject_sequence` (mask mode: a
sequence with any token out of the band leaves whole). The default (token, mask, upper 5, no lower) is decoupled PPO
with its weight cap.
Must never: let a masked-out position (padding holding -inf / nan) reach a weight, or send a gradient through a
weight (they are constants of the loss).
Details: docs/design/algorithms.md, "Rollout correction".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from asyncrl.algorithms.utils import LOG_RATIO_CLAMP, as_bool_mask

CorrectionLevel = Literal["token", "sequence", "geometric"]
CorrectionMode = Literal["mask", "truncate"]
LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
MODES: tuple[str, ...] = ("mask", "truncate")

__all__ = ["Correction", "correction_weights"]


@dataclass(frozen=True)
class Correction:
    """How the behaviour weights are taken and bounded (see the module's docstring)."""

    level: CorrectionLevel = "token"
    mode: CorrectionMode = "mask"
    upper: float | None = 5.0
    lower: float | None = None
    reject_sequence: bool = False

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"correction level {self.level!r}: one of {LEVELS}")
        if self.mode not in MODES:
            raise ValueError(f"correction mode {self.mode!r}: one of {MODES}")
        if self.upper is not None and not self.upper > 0:
            raise ValueError(f"correction upper bound (behavior_weight_cap) must be > 0, got {self.upper}")
        if self.lower is not None and not 0 <= self.lower < (self.upper if self.upper is not None else float("inf")):
            raise ValueError(f"correction lower bound must be >= 0 and below the upper one ({self.upper}), got {self.lower}")
        if self.mode == "truncate" and (self.lower is not None or self.reject_sequence):
            raise ValueError("correction mode 'truncate' bounds weights from above only: lower and reject_sequence "
                             "need mode 'mask'")

    @property
    def masks(self) -> bool:
        """Whether some token can leave the loss (and so move a batch-wide denominator)."""
        return self.mode == "mask" and (self.upper is not None or self.lower is not None)


def correction_weights(old_logprobs: Tensor, behavior_logprobs: Tensor | None, mask: Tensor,
                       spec: Correction = Correction()) -> tuple[Tensor, Tensor, Tensor]:
    """(weights, loss_mask, out) over [B, T]: each token's behaviour weight (1 without behaviour
    log-probs and on masked-out positions), the tokens left in the loss, and the valid tokens the
    correction took out of it (mask mode) or whose weight it truncated (truncate mode). All detached."""
    m = as_bool_mask(mask)
    if behavior_logprobs is None:  # nothing sampled elsewhere: nothing to correct
        return torch.ones_like(old_logprobs), m, torch.zeros_like(m)
    d = torch.where(m, old_logprobs.detach() - behavior_logprobs.detach(), 0)
    if spec.level == "token":
        log_w = d
    else:
        if d.ndim != 2:
            raise ValueError(f"correction level {spec.level!r} needs [B, T] log-probs, got shape {tuple(d.shape)}")
        total = d.sum(-1, keepdim=True)
        log_w = (total if spec.level == "sequence" else total / m.sum(-1, keepdim=True).clamp(min=1)).expand_as(d)
    w = torch.where(m, torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), 1)
    if spec.mode == "truncate":
        if spec.upper is None:
            return w, m, torch.zeros_like(m)
        out = m & (w > spec.upper)
        return torch.where(out, torch.full_like(w, spec.upper), w), m, out
    out = torch.zeros_like(m)
    if spec.upper is not None:
        out = out | (w > spec.upper)
    if spec.lower is not None:
        out = out | (w < spec.lower)
    out = m & out
    if spec.reject_sequence and out.ndim == 2:
        out = m & out.any(-1, keepdim=True)
    return w, m & ~out, out
