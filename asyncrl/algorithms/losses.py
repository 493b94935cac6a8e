"""Policy, value and KL losses over [B, T] per-token tensors.

Owns: the per-token KL estimators, the four loss-aggregation modes, the clipped PPO and GSPO
policy surrogates (with decoupled off-policy correction), the clipped value loss, and KL as a
reward penalty or as a loss term.

Must never: start a process, import Megatron / Ray / an engine, or send a gradient anywhere but
the current policy's `logprobs` (or the critic's `values`). Old, behaviour and reference
log-probs, advantages, returns and old values are constants here and are detached. Masked-out
entries are replaced with `torch.where` before any arithmetic, so padding holding garbage
(-inf, nan) reaches neither the loss nor a gradient, and an all-masked batch gives loss 0.
Metrics are python floats computed under `torch.no_grad()`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from asyncrl.algorithms.correction import Correction, correction_weights
from asyncrl.algorithms.utils import LOG_RATIO_CLAMP, as_bool_mask, masked_mean

KLKind = Literal["k1", "k2", "k3"]
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
K3_CLAMP = 10.0

__all__ = [
    "aggregate",
    "gspo_policy_loss",
    "kl_divergence",
    "kl_loss_term",
    "kl_penalty_rewards",
    "ppo_policy_loss",
    "value_loss",
]


def kl_divergence(logprobs: Tensor, ref_logprobs: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi; d = logprobs - ref_logprobs.

    k1 = d;  k2 = 0.5 * d^2;
    k3 = clamp(exp(x) - x - 1, -10, 10) with x = clamp(-d, -20, 20)  (low-variance, >= 0).
    Raises ValueError for an unknown kind.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    x = torch.clamp(-d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(x) - x - 1, -K3_CLAMP, K3_CLAMP)


def aggregate(values: Tensor, mask: Tensor, mode: AggMode) -> Tensor:
    """Reduce per-token values [B, T] to a scalar over valid tokens (m = mask != 0).

    token-mean:              sum_{b,t} m v / max(sum_{b,t} m, 1)
    seq-mean-token-mean:     mean over rows with >= 1 valid token of (sum_t m v / sum_t m)
    seq-mean-token-sum:      mean over rows with >= 1 valid token of (sum_t m v)
    seq-mean-token-sum-norm: sum_{b,t} m v / (B * T)     (T = padded length, a constant divisor)
    No valid token anywhere gives 0 (not nan). Raises ValueError for an unknown mode.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {mode!r}; expected one of {AGG_MODES}")
    m = as_bool_mask(mask)
    v = torch.where(m, values, 0)
    if mode == "token-mean":
        return v.sum() / m.sum().clamp(min=1)
    if v.ndim != 2:
        raise ValueError(f"aggregation mode {mode!r} needs [B, T] values, got shape {tuple(v.shape)}")
    if mode == "seq-mean-token-sum-norm":
        return v.sum() / max(v.numel(), 1)
    tokens_per_seq = m.sum(-1)
    per_seq = v.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens_per_seq.clamp(min=1)
    # Rows without a valid token contribute 0 to the sum and are left out of the count.
    return per_seq.sum() / (tokens_per_seq > 0).sum().clamp(min=1)


def _behavior_correction(
    old_logprobs: Tensor, behavior_logprobs: Tensor | None, mask: Tensor, cap: float | None,
    correction: Correction | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Return (w, loss_mask, capped) for decoupled PPO: `correction_weights` under `correction`, or
    (None) today's token-level mask at `cap`:

    w = sg(exp(clamp(old - behavior, -20, 20))) on valid tokens (1 without behaviour log-probs or
    on masked-out positions); capped = valid & (w > cap); loss_mask = valid & ~capped.
    """
    return correction_weights(old_logprobs, behavior_logprobs, mask, correction or Correction(upper=cap))


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """Return (max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high)), clipped-branch-active mask)."""
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _policy_metrics(
    *, mask: Tensor, loss_mask: Tensor, capped: Tensor, weights: Tensor, ratio: Tensor,
    log_ratio: Tensor, clip_active: Tensor,
) -> dict[str, float]:
    n_valid = mask.sum().clamp(min=1)
    return {
        "actor/clip_frac": masked_mean(clip_active.to(ratio.dtype), loss_mask),
        # k2 of the (clamped) proximal log-ratio: symmetric, so no choice of sampling direction.
        "actor/approx_kl": masked_mean(0.5 * log_ratio.square(), loss_mask),
        "actor/ratio_mean": masked_mean(ratio, loss_mask),
        "actor/behavior_cap_frac": capped.sum() / n_valid,
        "actor/behavior_capped_tokens": capped.sum().to(ratio.dtype),
        "actor/behavior_weight_mean": masked_mean(weights, mask),
    }


def _finish(metrics: dict[str, Tensor], lazy: bool) -> dict[str, Any]:
    """0-d tensors as they are (`lazy_metrics`: read once per step by the caller, no device
    synchronisation per call), else Python floats."""
    if lazy:
        return {k: v.detach() if isinstance(v, Tensor) else v for k, v in metrics.items()}
    return {k: float(v.item()) if isinstance(v, Tensor) else float(v) for k, v in metrics.items()}


def ppo_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
    behavior_logprobs: Tensor | None = None, behavior_weight_cap: float | None = None,
    agg: AggMode = "token-mean", lazy_metrics: bool = False, correction: Correction | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """Clipped PPO surrogate, optionally dual-clipped and decoupled (all inputs [B, T]).

    r_t = exp(clamp(logprobs_t - old_t, -20, 20))
    l_t = max(-A_t r_t, -A_t clamp(r_t, 1 - clip_low, 1 + clip_high))
    dual_clip = c > 1:  l_t = min(l_t, -A_t c) where A_t < 0
    behavior_logprobs:  l_t *= w_t = sg(exp(clamp(old_t - behavior_t, -20, 20)));
                        old_logprobs then play the proximal policy
    behavior_weight_cap = C: tokens with w_t > C leave the loss mask
    correction:         another rollout correction instead of that one (level token / sequence /
                        geometric, mask or truncate, a lower bound: asyncrl.algorithms.correction);
                        behavior_weight_cap is then ignored
    loss = aggregate(l, loss_mask, agg).

    Metrics: actor/clip_frac, actor/dual_clip_frac, actor/ratio_mean and actor/approx_kl
    (masked mean of the k2 estimate 0.5 * clamp(logprobs - old, -20, 20)^2) are over the tokens
    left in the loss; actor/behavior_cap_frac (capped / valid), actor/behavior_capped_tokens (count)
    and actor/behavior_weight_mean are over all valid tokens (capped: the tokens the correction took
    out of the loss, or in truncate mode the tokens whose weight it truncated).
    """
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    mask = as_bool_mask(mask)
    weights, loss_mask, capped = _behavior_correction(old_logprobs, behavior_logprobs, mask, behavior_weight_cap, correction)
    log_ratio = torch.where(loss_mask, logprobs - old_logprobs.detach(), 0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = torch.where(loss_mask, advantages.detach(), 0)
    per_token, clip_active = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    dual_active = torch.zeros_like(loss_mask)
    if dual_clip is not None:
        dual_bound = -adv * dual_clip
        dual_active = (adv < 0) & (per_token > dual_bound)
        per_token = torch.where(dual_active, dual_bound, per_token)
    loss = aggregate(per_token * weights, loss_mask, agg)
    with torch.no_grad():
        metrics = _policy_metrics(
            mask=mask, loss_mask=loss_mask, capped=capped, weights=weights, ratio=ratio,
            log_ratio=log_ratio, clip_active=clip_active,
        )
        metrics["actor/dual_clip_frac"] = masked_mean(dual_active.to(ratio.dtype), loss_mask)
    return loss, _finish(metrics, lazy_metrics)


def gspo_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_low: float, clip_high: float,
    behavior_logprobs: Tensor | None = None, behavior_weight_cap: float | None = None,
    agg: AggMode = "seq-mean-token-mean", lazy_metrics: bool = False, correction: Correction | None = None,
) -> tuple[Tensor, dict[str, Any]]:
    """GSPO: PPO clipping on the sequence-level ratio, in its per-token (GSPO-token) form.

    log s_i  = clamp(sum_t m (logprobs - old) / sum_t m, -20, 20)  (s_i = geometric mean of ratios)
    s_{i,t}  = sg(s_i) * exp(logprobs_t - sg(logprobs_t))  (value s_i; d s_{i,t} = s_i d logprobs_t)
    A_i      = masked mean over t of advantages[i, t]  (robust to left padding, equal to the
               per-token value when advantages are broadcast per sequence)
    l_{i,t}  = max(-A_i s_{i,t}, -A_i clamp(s_{i,t}, 1 - clip_low, 1 + clip_high))
    With seq-mean-token-mean and no behaviour weights this has exactly the GSPO sequence
    gradient. Decoupled correction and cap (or `correction`) as in `ppo_policy_loss`; a capped token is treated as
    masked out everywhere (it leaves s_i, A_i and the loss). Metrics as ppo's, without
    actor/dual_clip_frac; actor/ratio_mean is the token-weighted mean of s_i.
    """
    mask = as_bool_mask(mask)
    weights, loss_mask, capped = _behavior_correction(old_logprobs, behavior_logprobs, mask, behavior_weight_cap, correction)
    token_log_ratio = torch.where(loss_mask, logprobs - old_logprobs.detach(), 0)
    seq_log_ratio = masked_mean(token_log_ratio.detach(), loss_mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    live_logprobs = torch.where(loss_mask, logprobs, 0)
    ratio = torch.exp(seq_log_ratio[:, None] + (live_logprobs - live_logprobs.detach()))
    seq_adv = masked_mean(advantages.detach(), loss_mask, dim=-1)
    adv = torch.where(loss_mask, seq_adv[:, None], 0)
    per_token, clip_active = _clipped_surrogate(ratio, adv, clip_low, clip_high)
    loss = aggregate(per_token * weights, loss_mask, agg)
    with torch.no_grad():
        metrics = _policy_metrics(
            mask=mask, loss_mask=loss_mask, capped=capped, weights=weights, ratio=ratio,
            log_ratio=token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), clip_active=clip_active,
        )
    return loss, _finish(metrics, lazy_metrics)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
    clip: float = 0.2, agg: AggMode = "token-mean", lazy_metrics: bool = False,
) -> tuple[Tensor, dict[str, Any]]:
    """Clipped value loss: l_t = 0.5 * max((v_t - R_t)^2, (clamp(v_t, old_t - clip, old_t + clip) - R_t)^2).

    loss = aggregate(l, mask, agg). Metrics: critic/vf_clip_frac (valid tokens where the clipped
    term is strictly larger), critic/value_mean (masked mean of v).
    """
    m = as_bool_mask(mask)
    v = torch.where(m, values, 0)
    old = torch.where(m, old_values.detach(), 0)
    target = torch.where(m, returns.detach(), 0)
    unclipped = (v - target).square()
    clipped = (torch.clamp(v, old - clip, old + clip) - target).square()
    loss = aggregate(0.5 * torch.maximum(unclipped, clipped), m, agg)
    with torch.no_grad():
        metrics = {
            "critic/vf_clip_frac": masked_mean((clipped > unclipped).to(v.dtype), m),
            "critic/value_mean": masked_mean(v, m),
        }
    return loss, _finish(metrics, lazy_metrics)


@torch.no_grad()
def kl_penalty_rewards(
    token_rewards: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *,
    coef: float, kind: KLKind = "k1",
) -> Tensor:
    """KL as a reward penalty: r'_t = r_t - coef * kl_t on valid tokens, r_t unchanged elsewhere.

    kl_t = kl_divergence(logprobs_t, ref_logprobs_t, kind). A reward is a target: no grad.
    """
    m = as_bool_mask(mask)
    kl = kl_divergence(torch.where(m, logprobs, 0), torch.where(m, ref_logprobs, 0), kind)
    return torch.where(m, token_rewards - coef * kl, token_rewards)


def kl_loss_term(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *,
    coef: float, kind: KLKind = "k3", agg: AggMode = "token-mean", lazy_metrics: bool = False,
) -> tuple[Tensor, dict[str, Any]]:
    """KL as a loss term: coef * aggregate(kl_divergence(logprobs, sg(ref_logprobs), kind), mask, agg).

    Metrics: actor/kl_loss, the aggregated KL *before* multiplying by coef (so it stays
    comparable across coef values), and actor/kl_coef.
    """
    m = as_bool_mask(mask)
    kl = kl_divergence(torch.where(m, logprobs, 0), torch.where(m, ref_logprobs.detach(), 0), kind)
    kl_agg = aggregate(kl, m, agg)
    return coef * kl_agg, _finish({"actor/kl_loss": kl_agg.detach(), "actor/kl_coef": float(coef)}, lazy_metrics)
