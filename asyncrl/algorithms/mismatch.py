"""The engine/learner log-prob mismatch: how far the policy that sampled a token is from the proximal one.

Owns: the per-token statistics of d = log pi_prox - log pi_behave over valid tokens, split by version gap (0, 1, 2
or more), as sums a caller adds up over micro-batches and DP ranks (`mismatch_sums`, on the device, no host read),
and the metrics made from them on the host (`mismatch_metrics`: the k1 and k3 KL estimates, mean and max |d|, each
policy's perplexity and their ratio, the fraction of tokens outside `MISMATCH_BAND`, the token count).
Must never: change a loss, or read the device (sums stay tensors until the caller reads them once).
Details: docs/design/algorithms.md, "The log-prob mismatch".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from asyncrl.algorithms.utils import LOG_RATIO_CLAMP, as_bool_mask

MISMATCH_BAND = 2.0  # out of band: the token's probability moved by more than this factor either way
GAP_BUCKETS = ("all", "gap0", "gap1", "gap2+")  # rows of `mismatch_sums`
_COLUMNS = ("tokens", "d", "k3", "abs", "abs_max", "nll_behavior", "nll_proximal", "out_of_band")
MAX_COLUMN = _COLUMNS.index("abs_max")  # the one column whose parts combine by max, not by sum


def combine_mismatch_sums(parts: Sequence[Tensor], device: torch.device | str = "cpu") -> Tensor:
    """Several `mismatch_sums` as one (sums added, `MAX_COLUMN` maxed); zeros when there are none."""
    if not parts:
        return torch.zeros(len(GAP_BUCKETS), len(_COLUMNS), dtype=torch.float64, device=device)
    stacked = torch.stack(list(parts))
    total = stacked.sum(0)
    total[:, MAX_COLUMN] = stacked[:, :, MAX_COLUMN].amax(0)
    return total


def mismatch_sums(proximal: Tensor, behavior: Tensor, mask: Tensor, gaps: Tensor | None = None) -> Tensor:
    """[len(GAP_BUCKETS), 8] float64 sums over the valid tokens of [B, T] inputs: per bucket (all tokens,
    then version gap 0, 1, >= 2 from `gaps`, a [B, T] integer tensor; without it those rows are 0) the
    token count, sum d, sum k3, sum |d|, max |d|, sum -log pi_behave, sum -log pi_prox, tokens out of band.
    Sums (and maxima) of several calls add (and max) up to the sums of their union."""
    m = as_bool_mask(mask)
    # float64: two float32 log-probs differ by ~1e-6 at fp32's floor; exp(d) - 1 - d in float32 reads ~1e-9 there
    # whatever the gap (k3 ~ d^2 / 2 ~ 1e-13), and token sums of 1e5 lose what float32 cannot hold
    prox, beh = proximal.detach().double(), behavior.detach().double()
    d = torch.clamp(prox - beh, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token = torch.stack([
        torch.ones_like(d), d, torch.expm1(d) - d, d.abs(), d.abs(), -beh, -prox,
        (d.abs() > math.log(MISMATCH_BAND)).double(),
    ])  # [8, B, T]
    rows = [m]
    if gaps is not None:
        g = gaps.to(d.device)
        rows += [m & (g == 0), m & (g == 1), m & (g >= 2)]
    out = torch.zeros(len(GAP_BUCKETS), len(_COLUMNS), dtype=torch.float64, device=d.device)
    for i, sel in enumerate(rows):
        vals = torch.where(sel, per_token, 0.0)
        out[i] = vals.flatten(1).sum(1)
        out[i, MAX_COLUMN] = vals[MAX_COLUMN].max() if vals[MAX_COLUMN].numel() else 0.0
    return out


def mismatch_metrics(sums: Sequence[Sequence[float]] | Tensor, prefix: str = "mismatch") -> dict[str, float]:
    """`prefix/<metric>` for all tokens and `prefix/<bucket>/<metric>` for each version-gap bucket that
    holds tokens, from `mismatch_sums` added up (and maxed) over every part of the batch."""
    rows = sums.tolist() if isinstance(sums, Tensor) else [list(r) for r in sums]
    out: dict[str, float] = {}
    for bucket, row in zip(GAP_BUCKETS, rows, strict=True):
        n, d, k3, absd, abs_max, nll_b, nll_p, band = row
        if n <= 0:
            continue
        name = prefix if bucket == "all" else f"{prefix}/{bucket}"
        ppl_b, ppl_p = math.exp(min(nll_b / n, 700.0)), math.exp(min(nll_p / n, 700.0))
        out |= {
            f"{name}/k1": -d / n, f"{name}/k3": k3 / n, f"{name}/abs_diff_mean": absd / n,
            f"{name}/abs_diff_max": abs_max, f"{name}/ppl_behavior": ppl_b, f"{name}/ppl_proximal": ppl_p,
            f"{name}/ppl_ratio": ppl_p / ppl_b, f"{name}/out_of_band_frac": band / n, f"{name}/tokens": n,
        }
    return out
