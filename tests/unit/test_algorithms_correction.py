"""Rollout correction modes (asyncrl.algorithms.correction) against hand-computed weights and masks,
and the default against decoupled PPO's weight cap as it was."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import ppo_policy_loss
from asyncrl.algorithms.correction import Correction, correction_weights
from asyncrl.config import AlgorithmConfig
from asyncrl.config.base import ConfigError

LN = math.log
# two sequences; the second has 2 valid tokens of 3. d = old - behavior per token:
#   seq 0: ln 3, ln 0.25, ln 2      seq 1: ln 0.5, ln 8, (padding: behaviour holds -inf)
OLD = torch.zeros(2, 3)
BEHAVIOR = torch.tensor([[-LN(3), -LN(0.25), -LN(2)], [-LN(0.5), -LN(8), float("-inf")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def weights(**kw):
    w, keep, out = correction_weights(OLD, BEHAVIOR, MASK, Correction(**kw))
    return [[round(float(x), 6) for x in row] for row in w], keep.tolist(), out.tolist()


def test_token_level_mask_is_decoupled_ppo_with_its_cap():
    w, keep, out = weights(upper=2.5)
    assert w == [[3.0, 0.25, 2.0], [0.5, 8.0, 1.0]]  # padding: weight 1, never the -inf behind it
    assert keep == [[False, True, True], [True, False, False]] and out == [[True, False, False], [False, True, False]]


def test_icepop_band_masks_both_sides_and_a_rejected_sequence_leaves_whole():
    _, keep, out = weights(upper=2.5, lower=0.4)  # 0.25 is below the band now
    assert keep == [[False, False, True], [True, False, False]]
    _, keep, out = weights(upper=10.0, lower=0.4, reject_sequence=True)  # seq 0's 0.25 rejects seq 0 whole
    assert keep == [[False, False, False], [True, True, False]] and out == [[True, True, True], [False, False, False]]


def test_truncation_bounds_weights_and_keeps_every_token():
    w, keep, out = weights(mode="truncate", upper=2.5)
    assert w == [[2.5, 0.25, 2.0], [0.5, 2.5, 1.0]]
    assert keep == MASK.bool().tolist() and out == [[True, False, False], [False, True, False]]


def test_sequence_and_geometric_levels_share_one_weight_per_sequence():
    # seq 0: 3 * 0.25 * 2 = 1.5 (geometric 1.5^(1/3)); seq 1: 0.5 * 8 = 4 (geometric 2), its padding left out
    w, keep, _ = weights(level="sequence", upper=3.0)
    assert w == [[1.5] * 3, [4.0, 4.0, 1.0]] and keep == [[True] * 3, [False, False, False]]
    w, keep, _ = weights(level="geometric", mode="truncate", upper=1.9)
    assert w == [[round(1.5 ** (1 / 3), 6)] * 3, [1.9, 1.9, 1.0]] and keep == MASK.bool().tolist()


def test_the_default_loss_is_the_capped_decoupled_loss_as_before():
    torch.manual_seed(0)
    logp = torch.randn(2, 3, requires_grad=True)
    old, adv = torch.zeros(2, 3), torch.tensor([[1.0, -0.5, 2.0], [0.3, 1.0, 0.0]])
    beh = torch.tensor([[-0.1, -2.0, 0.2], [0.0, -3.0, 0.0]])  # w = 1.1, 7.4 (> 5: masked), 0.8; 1, 20 (masked)
    before, m_before = ppo_policy_loss(logp, old, adv, MASK, behavior_logprobs=beh, behavior_weight_cap=5.0)
    default = AlgorithmConfig().rollout_correction()
    now, m_now = ppo_policy_loss(logp, old, adv, MASK, behavior_logprobs=beh, correction=default)
    assert default == Correction() and torch.equal(before, now) and m_now == m_before
    assert m_now["actor/behavior_capped_tokens"] == 2.0

    def by_hand(w, keep):  # token-mean over the kept tokens of max(-A w r, -A w clip(r, 0.8, 1.2))
        r = torch.exp(logp.detach())
        per = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)) * w
        return float(per[keep].sum() / keep.sum())

    w = torch.exp(old - beh)
    keep = MASK.bool() & (w <= 5.0)
    assert float(now) == pytest.approx(by_hand(w, keep), rel=1e-6)
    truncated, m = ppo_policy_loss(logp, old, adv, MASK, behavior_logprobs=beh,
                                   correction=Correction(mode="truncate", upper=5.0))
    assert m["actor/behavior_capped_tokens"] == 2.0  # truncated, not masked: all 5 valid tokens in the loss
    assert float(truncated) == pytest.approx(by_hand(w.clamp(max=5.0), MASK.bool()), rel=1e-6)


def test_the_config_section_chooses_and_refuses_what_cannot_mean_anything():
    algo = AlgorithmConfig(behavior_weight_cap=2.0, correction={"level": "geometric", "lower": 0.5, "reject_sequence": True})
    assert algo.rollout_correction() == Correction(level="geometric", upper=2.0, lower=0.5, reject_sequence=True)
    with pytest.raises((ConfigError, ValueError), match="truncate"):
        AlgorithmConfig(correction={"mode": "truncate", "lower": 0.5})
    with pytest.raises((ConfigError, ValueError), match="lower bound"):
        AlgorithmConfig(behavior_weight_cap=2.0, correction={"lower": 3.0})
    # truncation takes no token out: the update's own first forward stays exact beside a KL loss term
    kl = dict(kl_coef=0.1, kl_mode="loss")
    assert not AlgorithmConfig(**kl).proximal_in_update(with_reference=True)
    assert AlgorithmConfig(**kl, correction={"mode": "truncate"}).proximal_in_update(with_reference=True)
