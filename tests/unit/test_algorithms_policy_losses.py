"""Policy losses (PPO, GSPO) on hand-computed cases, gradients, the decoupled cap, and numerical edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import gspo_policy_loss, kl_loss_term, ppo_policy_loss, value_loss

DTYPES = [torch.float32, torch.float64]
F64 = torch.float64


def t(x, dtype=F64, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(actual: torch.Tensor, expected, *, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach(), torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- PPO


def ppo_case(dtype=F64):
    # ratios [1.5, 0.5, 0.5, 1.1] with A [1, 1, -1, 2], clip 0.2:
    # t0: max(-1.5, -1.2) = -1.2 clipped | t1: max(-0.5, -0.8) = -0.5 | t2: max(0.5, 0.8) = 0.8 clipped
    # t3: max(-2.2, -2.2) = -2.2 (1.1 is inside the clip range) -> token-mean = -3.1 / 4 = -0.775
    old = t([[-1.0, -1.0, -1.0, -1.0]], dtype)
    logp = (old + torch.log(t([[1.5, 0.5, 0.5, 1.1]], dtype))).requires_grad_()
    adv = t([[1.0, 1.0, -1.0, 2.0]], dtype)
    return logp, old, adv


@pytest.mark.parametrize("dtype", DTYPES)
def test_ppo_hand_values_and_grad(dtype):
    logp, old, adv = ppo_case(dtype)
    loss, metrics = ppo_policy_loss(logp, old, adv, torch.ones(1, 4))
    assert loss.item() == pytest.approx(-0.775, rel=1e-6)
    assert metrics["actor/clip_frac"] == pytest.approx(0.5)
    assert metrics["actor/ratio_mean"] == pytest.approx(0.9, rel=1e-6)
    assert metrics["actor/dual_clip_frac"] == 0.0 and metrics["actor/behavior_cap_frac"] == 0.0
    # approx_kl = mean of 0.5 * ln(r)^2 (k2)
    expected_kl = sum(0.5 * math.log(r) ** 2 for r in (1.5, 0.5, 0.5, 1.1)) / 4
    assert metrics["actor/approx_kl"] == pytest.approx(expected_kl, rel=1e-5)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    # d/dlogp = -A r / 4 on the unclipped branch, 0 on the clipped one
    close(logp.grad, [[0.0, -0.125, 0.0, -0.55]], atol=1e-6)


def test_ppo_asymmetric_clip():
    logp, old, adv = ppo_case()
    # clip_high 0.6: t0 (r = 1.5, A > 0) is no longer clipped -> -1.5; clip_low 0.2 still clips t2
    loss, metrics = ppo_policy_loss(logp, old, adv, torch.ones(1, 4), clip_low=0.2, clip_high=0.6)
    assert loss.item() == pytest.approx((-1.5 - 0.5 + 0.8 - 2.2) / 4)
    assert metrics["actor/clip_frac"] == pytest.approx(0.25)


def test_ppo_dual_clip_only_acts_on_negative_advantages():
    # ratios [5, 2, 5, 0.1], A [-1, -1, 1, 2], c = 3:
    # t0: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual) | t1: max(2, 1.2) = 2 < 3, unchanged
    # t2: A > 0: max(-5, -1.2) = -1.2, unchanged | t3: max(-0.2, -1.6) = -0.2, unchanged
    old = t([[0.0, 0.0, 0.0, 0.0]])
    adv = t([[-1.0, -1.0, 1.0, 2.0]])
    ratios = t([[5.0, 2.0, 5.0, 0.1]])

    def run(dual):
        logp = torch.log(ratios).requires_grad_()
        loss, metrics = ppo_policy_loss(logp, old, adv, torch.ones(1, 4), dual_clip=dual)
        loss.backward()
        return loss, metrics, logp.grad

    loss_d, metrics_d, grad_d = run(3.0)
    loss_n, _, grad_n = run(None)
    assert loss_d.item() == pytest.approx((3 + 2 - 1.2 - 0.2) / 4)
    assert loss_n.item() == pytest.approx((5 + 2 - 1.2 - 0.2) / 4)
    assert metrics_d["actor/dual_clip_frac"] == pytest.approx(0.25)
    assert grad_d[0, 0] == 0 and grad_n[0, 0] == pytest.approx(5 / 4)
    assert torch.equal(grad_d[0, 1:], grad_n[0, 1:])  # t1..t3 untouched, positive-A included


@pytest.mark.parametrize("bad", [1.0, 0.5])
def test_ppo_dual_clip_must_exceed_one(bad):
    logp, old, adv = ppo_case()
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(logp, old, adv, torch.ones(1, 4), dual_clip=bad)


def behavior_case():
    # logp = old (ratio 1), A = 1; old - behavior = [ln 2, ln 10, 0, -ln 2] -> w = [2, 10, 1, 0.5]
    old = t([[-1.0, -2.0, -0.5, -3.0]], grad=True)
    behavior = (old.detach() - torch.log(t([[2.0, 10.0, 1.0, 0.5]]))).requires_grad_()
    logp = old.detach().clone().requires_grad_()
    return logp, old, behavior, t([[1.0, 1.0, 1.0, 1.0]])


def test_ppo_behavior_weights_and_cap():
    logp, old, behavior, adv = behavior_case()
    loss, metrics = ppo_policy_loss(logp, old, adv, torch.ones(1, 4), behavior_logprobs=behavior, behavior_weight_cap=5.0)
    # w = 10 > 5 is masked out: (-2 - 1 - 0.5) / 3 remaining tokens
    assert loss.item() == pytest.approx(-3.5 / 3)
    assert metrics["actor/behavior_cap_frac"] == pytest.approx(0.25)
    assert metrics["actor/behavior_capped_tokens"] == 1.0
    assert metrics["actor/behavior_weight_mean"] == pytest.approx((2 + 10 + 1 + 0.5) / 4)
    loss.backward()
    close(logp.grad, [[-2 / 3, 0.0, -1 / 3, -0.5 / 3]])
    assert logp.grad[0, 1].item() == 0.0  # exactly zero on the capped token
    assert old.grad is None and behavior.grad is None  # weights (and old) are detached

    logp2, old2, behavior2, adv2 = behavior_case()
    loss_nocap, metrics_nocap = ppo_policy_loss(logp2, old2, adv2, torch.ones(1, 4), behavior_logprobs=behavior2)
    assert loss_nocap.item() == pytest.approx(-13.5 / 4)
    assert metrics_nocap["actor/behavior_capped_tokens"] == 0.0


def test_ppo_masked_tokens_get_zero_grad_and_float_mask_equals_bool_mask():
    logp, old, adv = ppo_case()
    logp_pad = logp.detach().clone()
    logp_pad[0, 1] = float("-inf")  # garbage in padding
    logp_pad.requires_grad_()
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    loss, _ = ppo_policy_loss(logp_pad, old, adv, mask)
    loss_bool, _ = ppo_policy_loss(logp_pad, old, adv, mask.bool())
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.2) / 3) and loss.item() == loss_bool.item()
    loss.backward()
    assert logp_pad.grad[0, 1].item() == 0.0 and torch.isfinite(logp_pad.grad).all()


def test_ppo_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    # log-ratios kept away from the clip (ln 0.8, ln 1.2) and dual (ln 1.5) kinks
    log_ratio = t([[-0.5, -0.1, 0.05, 0.3, 0.6], [0.6, -0.4, 0.1, 0.0, 0.7]])
    old = torch.randn(2, 5, generator=g, dtype=F64)
    behavior = old - t([[0.3, -0.2, 0.1, 2.0, 0.0], [0.5, 0.5, -0.5, 0.0, 0.1]])
    adv = t([[1.0, -1.0, 0.5, -2.0, -1.0], [1.0, -0.5, 2.0, 1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 1]])
    logp = (old + log_ratio).requires_grad_()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        def f(lp):
            return ppo_policy_loss(lp, old, adv, mask, dual_clip=1.5, behavior_logprobs=behavior, behavior_weight_cap=5.0, agg=agg)[0]
        assert torch.autograd.gradcheck(f, (logp,))


# ---------------------------------------------------------------- GSPO


def test_gspo_hand_values_and_grad():
    # row 0: mask [1, 1, 0], log-ratios [0.2, 0.4, (9)] -> s0 = e^0.3 = 1.34986 > 1.2, A0 = 1 -> -1.2 (clipped)
    # row 1: log-ratios [0.1, -0.1, 0] -> s1 = 1, A1 = masked mean of [-1, -3, -2] = -2 -> 2 per token
    # seq-mean-token-mean = (-1.2 + 2) / 2 = 0.4
    old = t([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], grad=True)
    logp = (old.detach() + t([[0.2, 0.4, 9.0], [0.1, -0.1, 0.0]])).requires_grad_()
    adv = t([[1.0, 1.0, 50.0], [-1.0, -3.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, metrics = gspo_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(0.4)
    assert metrics["actor/clip_frac"] == pytest.approx(2 / 5)
    assert metrics["actor/ratio_mean"] == pytest.approx((2 * math.exp(0.3) + 3) / 5)
    assert "actor/dual_clip_frac" not in metrics
    loss.backward()
    # row 1 token t: (1/2 rows) * (1/3 tokens) * (-A1) * s1 = 1/3; row 0 clipped -> 0
    close(logp.grad, [[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    assert old.grad is None


def test_gspo_gradient_equals_sequence_level_objective():
    # GSPO-token with sequence advantages has exactly the GSPO (sequence-ratio) gradient.
    g = torch.Generator().manual_seed(2)
    old = torch.randn(3, 6, generator=g, dtype=F64)
    delta = 0.05 * torch.randn(3, 6, generator=g, dtype=F64)
    adv = t([[1.0] * 6, [-0.5] * 6, [2.0] * 6])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    logp = (old + delta).requires_grad_()
    gspo_policy_loss(logp, old, adv, mask, clip_low=3e-4, clip_high=4e-4)[0].backward()
    lp_ref = (old + delta).requires_grad_()
    s = torch.exp(((lp_ref - old) * mask).sum(-1) / mask.sum(-1))
    a = adv[:, 0]
    ref = torch.maximum(-a * s, -a * s.clamp(1 - 3e-4, 1 + 4e-4)).mean()
    ref.backward()
    close(logp.grad, lp_ref.grad, atol=1e-12)
    assert logp.grad.abs().sum() > 0


def test_gspo_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    old = torch.randn(3, 4, generator=g, dtype=F64)
    # per-row mean log-ratios 0.4, -0.075, 0.0 (with clip 0.2: clipped, unclipped, unclipped)
    logp = (old + t([[0.3, 0.5, 0.4, 0.0], [-0.1, -0.05, 0.2, -0.3], [0.1, -0.1, 0.05, -0.05]])).requires_grad_()
    adv = t([[1.0] * 4, [-1.0] * 4, [0.5] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    for agg in ("seq-mean-token-mean", "token-mean"):
        assert torch.autograd.gradcheck(lambda lp: gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, agg=agg)[0], (logp,))


def test_gspo_capped_token_leaves_sequence_ratio():
    # w = [1, 1, 10]: token 2 is capped, so s = exp(mean(0.1, 0.3)) = e^0.2, ignoring its log-ratio 5
    old = t([[0.0, 0.0, 0.0]])
    behavior = old - torch.log(t([[1.0, 1.0, 10.0]]))
    logp = (old + t([[0.1, 0.3, 5.0]])).requires_grad_()
    loss, metrics = gspo_policy_loss(logp, old, t([[1.0, 1.0, 1.0]]), torch.ones(1, 3), clip_low=0.5, clip_high=0.5,
                                     behavior_logprobs=behavior, behavior_weight_cap=5.0)
    assert metrics["actor/ratio_mean"] == pytest.approx(math.exp(0.2))
    assert metrics["actor/behavior_capped_tokens"] == 1.0
    assert loss.item() == pytest.approx(-math.exp(0.2))
    loss.backward()
    assert logp.grad[0, 2].item() == 0.0 and logp.grad[0, 0].item() == pytest.approx(-math.exp(0.2) / 2)


# ---------------------------------------------------------------- numerical robustness


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [None, 5.0])
@pytest.mark.parametrize("policy_loss", [ppo_policy_loss, gspo_policy_loss])
def test_extreme_log_ratios_stay_finite(dtype, cap, policy_loss):
    old = t([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype)
    logp = (old + t([[1000.0, -1000.0, 1000.0, -1000.0], [-1000.0, 1000.0, 0.5, 0.0]], dtype)).requires_grad_()
    behavior = old + t([[-1000.0, 1000.0, 1000.0, -1000.0], [1000.0, -1000.0, 0.0, 0.0]], dtype)
    adv = t([[1.0, -1.0, -1.0, 1.0], [-1.0, -1.0, 1.0, 1.0]], dtype)
    loss, metrics = policy_loss(logp, old, adv, torch.ones(2, 4), clip_low=0.2, clip_high=0.2,
                                behavior_logprobs=behavior, behavior_weight_cap=cap)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("policy_loss", [ppo_policy_loss, gspo_policy_loss])
def test_fully_masked_batch(policy_loss):
    logp = t([[float("-inf"), 0.0], [0.0, float("nan")]], grad=True)
    kw = dict(clip_low=0.2, clip_high=0.2, behavior_logprobs=torch.zeros(2, 2), behavior_weight_cap=2.0)
    loss, metrics = policy_loss(logp, torch.zeros(2, 2), torch.ones(2, 2), torch.zeros(2, 2), **kw)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 2, dtype=F64))
    assert all(v == 0.0 for v in metrics.values())
    vl, vm = value_loss(logp, torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    kl, km = kl_loss_term(logp, torch.zeros(2, 2), torch.zeros(2, 2), coef=1.0)
    assert vl.item() == 0.0 and kl.item() == 0.0
    assert all(math.isfinite(x) for x in [*vm.values(), *km.values()])
