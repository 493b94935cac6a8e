"""Advantage estimators on hand-computed cases (numbers written out), plus a slow GAE reference."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import (
    gae_advantages,
    grpo_advantages,
    masked_mean,
    masked_whiten,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards_from_sequence,
    weight_negative_advantages,
)

DTYPES = [torch.float32, torch.float64]


def close(actual: torch.Tensor, expected, *, atol: float = 1e-5) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, atol=atol, rtol=1e-5)


def whiten_ref(xs: list[float]) -> list[float]:
    """Slow reference: (x - mean) / unbiased std, matching masked_whiten's eps=1e-8 to 1e-7."""
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
    return [(x - mean) / std for x in xs]


# ---------------------------------------------------------------- GRPO / Dr. GRPO


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_non_contiguous_groups_hand_values(dtype):
    # group 5: [1, 2, 3] -> mean 2, unbiased std 1 -> [-1, 0, 1]
    # group 9: [4, 0]    -> mean 2, unbiased std sqrt(8) -> [+2/sqrt(8), -2/sqrt(8)] = [+0.70711, -0.70711]
    # group 42: [7]      -> size 1 -> 0
    rewards = torch.tensor([1.0, 4.0, 2.0, 0.0, 3.0, 7.0], dtype=dtype)
    ids = torch.tensor([5, 9, 5, 9, 5, 42])
    adv = grpo_advantages(rewards, ids, eps=0.0)
    assert adv.dtype == dtype
    close(adv, [-1.0, 0.70710678, 0.0, -0.70710678, 1.0, 0.0])
    # default eps: divided by (std + 1e-6)
    close(grpo_advantages(rewards, ids)[0:1], [-1.0 / (1.0 + 1e-6)], atol=1e-7)


def test_grpo_without_std_scaling_only_removes_mean():
    rewards = torch.tensor([1.0, 4.0, 2.0, 0.0, 3.0, 7.0])
    ids = torch.tensor([5, 9, 5, 9, 5, 42])
    close(grpo_advantages(rewards, ids, scale_by_std=False), [-1.0, 2.0, 0.0, -2.0, 1.0, 0.0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_all_equal_rewards_give_exact_zero_not_nan(dtype):
    # 0.1 * 3 / 3 != 0.1 in float: a naive r - mean leaves rounding that /(std + eps) would amplify.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.3, 1e6 + 0.7, 1e6 + 0.7], dtype=dtype)
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
    adv = grpo_advantages(rewards, ids)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert torch.equal(rloo_advantages(rewards, ids), torch.zeros_like(adv))


def test_grpo_all_singletons_and_empty_and_int_rewards():
    assert torch.equal(grpo_advantages(torch.tensor([3.0, -1.0]), torch.tensor([1, 2])), torch.zeros(2))
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    adv = grpo_advantages(torch.tensor([0, 1, 0, 1]), torch.tensor([3, 3, 3, 3]), eps=0.0)
    # [0, 1, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.5 * sqrt(3) = +-0.86603
    assert adv.is_floating_point()
    close(adv, [-0.8660254, 0.8660254, -0.8660254, 0.8660254])


def test_grpo_has_no_grad():
    rewards = torch.tensor([1.0, 2.0], requires_grad=True)
    assert not grpo_advantages(rewards, torch.tensor([0, 0])).requires_grad


@pytest.mark.parametrize("estimator", [
    lambda r: grpo_advantages(r, torch.tensor([0, 0, 1])),
    lambda r: rloo_advantages(r, torch.tensor([0, 0, 1])),
    lambda r: weight_negative_advantages(r, 0.5),
    lambda r: weight_negative_advantages(r, 1.0),
], ids=["grpo", "rloo", "negative-weight", "negative-weight-1"])
def test_sequence_level_estimators_return_targets_without_grad(estimator):
    rewards = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    assert not estimator(rewards).requires_grad


# ---------------------------------------------------------------- RLOO


@pytest.mark.parametrize("dtype", DTYPES)
def test_rloo_hand_values(dtype):
    # group 5 [1, 2, 3]: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5
    # group 9 [4, 0]: 4 - 0 = 4, 0 - 4 = -4; group 42 [7]: size 1 -> 0
    rewards = torch.tensor([1.0, 4.0, 2.0, 0.0, 3.0, 7.0], dtype=dtype)
    ids = torch.tensor([5, 9, 5, 9, 5, 42])
    close(rloo_advantages(rewards, ids), [-1.5, 4.0, 0.0, -4.0, 1.5, 0.0])


# ---------------------------------------------------------------- sequence reward -> token reward


def test_token_rewards_from_sequence_last_valid_token():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    out = token_rewards_from_sequence(torch.tensor([1.5, -2.0, 3.0, 4.0]), mask)
    expected = [[0, 0, 0, 1.5, 0], [0, 0, -2.0, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 4.0]]
    assert torch.equal(out, torch.tensor(expected))


# ---------------------------------------------------------------- REINFORCE++


@pytest.mark.parametrize("dtype", DTYPES)
def test_reinforce_pp_reward_to_go_gamma_half(dtype):
    # gamma = 0.5. Row 0: rewards [0, 0, 1] -> G = [0.25, 0.5, 1].
    # Row 1: rewards [0, 2, (9, masked)] -> G = [1, 2, -]: a masked reward is ignored.
    # Valid G = [0.25, 0.5, 1, 1, 2]: mean 0.95, deviations [-0.7, -0.45, 0.05, 0.05, 1.05],
    # sum of squares 1.8, unbiased var 0.45 -> A = deviation / sqrt(0.45).
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s = math.sqrt(0.45)
    expected = [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]]
    close(reinforce_pp_advantages(rewards, mask, gamma=0.5), expected)


def test_reinforce_pp_masked_gap_is_not_a_discount_step():
    # Row [1, (5 masked), 1, 1], gamma 0.5: G3 = 1, G2 = 1 + 0.5 = 1.5, G0 = 1 + 0.5 * 1.5 = 1.75.
    # (Counting the gap as a step would give G0 = 1.375; counting its reward, G0 > 2.)
    rewards = torch.tensor([[1.0, 5.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 1], [0, 0, 0, 0]])
    w = whiten_ref([1.75, 1.5, 1.0])
    close(reinforce_pp_advantages(rewards, mask, gamma=0.5), [[w[0], 0.0, w[1], w[2]], [0.0] * 4])


def test_reinforce_pp_fully_masked_batch_is_zero():
    out = reinforce_pp_advantages(torch.ones(2, 3), torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


# ---------------------------------------------------------------- GAE


def test_gae_hand_values():
    # T = 2, r = [0, 1], V = [0.5, 0.2], gamma 0.9, lam 0.8 (position 2 is padding with V = 100):
    # delta1 = 1 + 0.9 * 0 - 0.2 = 0.8 (V past the last valid token is 0), A1 = 0.8
    # delta0 = 0 + 0.9 * 0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72 * 0.8 = 0.256
    # returns = A + V = [0.756, 1.0]; whitening two values gives -+1/sqrt(2).
    rewards = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    close(ret, [[0.756, 1.0, 0.0]], atol=1e-12)
    close(adv, [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]], atol=1e-7)


def gae_reference(rewards, values, mask, gamma, lam):
    """Slow per-row loop over the valid positions only, in python floats."""
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        idx = [t for t in range(len(rewards[b])) if mask[b][t]]
        last_gae, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b][t] + gamma * next_v - values[b][t]
            last_gae = delta + gamma * lam * last_gae
            adv[b][t], ret[b][t] = last_gae, last_gae + values[b][t]
            next_v = values[b][t]
    flat = [adv[b][t] for b in range(len(adv)) for t in range(len(adv[b])) if mask[b][t]]
    white = iter(whiten_ref(flat))
    adv_w = [[next(white) if mask[b][t] else 0.0 for t in range(len(adv[b]))] for b in range(len(adv))]
    return adv_w, ret


@pytest.mark.parametrize("dtype", DTYPES)
def test_gae_matches_reference_loop(dtype):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 9
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    # left prompt, right padding, a masked tool span inside row 2, and an empty row 3
    mask = torch.tensor([
        [0, 0, 1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 1, 1, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
    ])
    ref_adv, ref_ret = gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), 0.95, 0.7)
    adv, ret = gae_advantages(rewards.to(dtype), values.to(dtype), mask, gamma=0.95, lam=0.7)
    assert adv.dtype == ret.dtype == dtype
    close(ret, ref_ret, atol=1e-5)
    close(adv, ref_adv, atol=1e-5)
    # sanity on the reference itself: gamma/lam matter
    other_adv, _ = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert not torch.allclose(other_adv, torch.as_tensor(ref_adv, dtype=torch.float64))


def test_gae_garbage_in_padding_does_not_leak():
    rewards = torch.tensor([[1.0, 0.5, float("nan")]])
    values = torch.tensor([[0.2, 0.3, float("inf")]])
    adv, ret = gae_advantages(rewards, values, torch.tensor([[1, 1, 0]]), gamma=0.9, lam=0.9)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    # delta1 = 0.5 - 0.3 = 0.2; A0 = (1 + 0.27 - 0.2) + 0.81 * 0.2 = 1.232
    close(ret, [[1.232 + 0.2, 0.2 + 0.3, 0.0]])


# ---------------------------------------------------------------- helpers


def test_masked_mean_and_whiten_helpers():
    v = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 5.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(v, m).item() == pytest.approx(2.0)
    close(masked_mean(v, m, dim=-1), [1.5, 3.0])
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0
    # [1, 2, 3]: mean 2, unbiased var 1 -> [-1, 0, 1] (eps 1e-8 is below tolerance)
    close(masked_whiten(v, m), [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(masked_whiten(v, torch.zeros_like(m)), torch.zeros_like(v))


def test_weight_negative_advantages_scales_only_the_negative_ones():
    adv = torch.tensor([[1.5, -2.0, 0.0], [-0.5, 0.25, -1.0]])
    close(weight_negative_advantages(adv, 0.5), [[1.5, -1.0, 0.0], [-0.25, 0.25, -0.5]])
    close(weight_negative_advantages(adv, 0.0), [[1.5, 0.0, 0.0], [0.0, 0.25, 0.0]])
    same = weight_negative_advantages(adv, 1.0)
    close(same, adv)
    assert same is not adv and not same.requires_grad
    with pytest.raises(ValueError, match="must lie in"):
        weight_negative_advantages(adv, 1.5)
