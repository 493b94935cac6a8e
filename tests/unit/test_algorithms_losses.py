"""KL estimators, aggregation, value loss and KL terms on hand-computed cases, gradients, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms import aggregate, kl_divergence, kl_loss_term, kl_penalty_rewards, value_loss

DTYPES = [torch.float32, torch.float64]
F64 = torch.float64


def t(x, dtype=F64, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(actual: torch.Tensor, expected, *, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach(), torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- KL estimators


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_kinds_hand_values(dtype):
    # d = logp - ref = [0.5, -0.5, -2]
    logp, ref = t([0.0, -1.0, -2.0], dtype), t([-0.5, -0.5, 0.0], dtype)
    close(kl_divergence(logp, ref, "k1"), [0.5, -0.5, -2.0])
    close(kl_divergence(logp, ref, "k2"), [0.125, 0.125, 2.0])
    # k3 with x = ref - logp = [-0.5, 0.5, 2]: e^-0.5 + 0.5 - 1, e^0.5 - 1.5, e^2 - 3
    close(kl_divergence(logp, ref, "k3"), [0.10653066, 0.14872127, 4.38905610], atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_k3_clamps(dtype):
    # x = 3: e^3 - 4 = 16.09 -> clamped to 10; x = -30 -> clamped to -20: e^-20 + 19 -> 10;
    # logp = -inf: x = +inf would give inf - inf = nan without the [-20, 20] clamp on x.
    logp = t([0.0, 0.0, float("-inf"), 1000.0], dtype)
    ref = t([3.0, -30.0, 0.0, 0.0], dtype)
    out = kl_divergence(logp, ref, "k3")
    assert torch.equal(out, t([10.0, 10.0, 10.0, 10.0], dtype))


def test_unknown_kl_kind_is_named():
    with pytest.raises(ValueError, match="'k4'"):
        kl_divergence(torch.zeros(2), torch.zeros(2), "k4")


# ---------------------------------------------------------------- aggregate

VALUES = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
MASK = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2 rows; the empty row is excluded
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 rows
        ("seq-mean-token-sum-norm", 7 / 9),  # 7 / (B=3 * T=3)
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_aggregate_modes_hand_values(mode, expected, dtype):
    out = aggregate(t(VALUES, dtype), torch.tensor(MASK), mode)
    assert out.dim() == 0 and out.dtype == dtype
    assert out.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_aggregate_all_masked_is_zero_and_padding_garbage_gets_no_grad(mode):
    v = t([[float("nan"), float("inf")], [1.0, -float("inf")]], grad=True)
    out = aggregate(v, torch.zeros(2, 2), mode)
    assert out.item() == 0.0
    out = aggregate(v, torch.tensor([[0, 0], [1, 0]]), mode)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(v.grad).all()
    assert v.grad[0].abs().sum() == 0 and v.grad[1, 1] == 0 and v.grad[1, 0] > 0


def test_aggregate_unknown_mode():
    with pytest.raises(ValueError, match="'mean'"):
        aggregate(torch.zeros(1, 2), torch.ones(1, 2), "mean")


# ---------------------------------------------------------------- value loss


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_loss_hand_values_and_grad(dtype):
    # clip 0.2
    # t0: v 1, old 0.9, R 2: clamp(1, 0.7, 1.1) = 1 -> both 1 -> 0.5
    # t1: v 2, old 1, R 2: unclipped 0, clipped (1.2 - 2)^2 = 0.64 -> 0.32 (clip active, grad 0)
    # t2: v 0.5, old 0.5, R 0: 0.25 -> 0.125 | t3 masked
    # token-mean = (0.5 + 0.32 + 0.125) / 3 = 0.315
    values = t([[1.0, 2.0, 0.5, 9.0]], dtype, grad=True)
    old = t([[0.9, 1.0, 0.5, 0.0]], dtype, grad=True)
    returns = t([[2.0, 2.0, 0.0, 0.0]], dtype, grad=True)
    loss, metrics = value_loss(values, old, returns, torch.tensor([[1, 1, 1, 0]]))
    assert loss.item() == pytest.approx(0.315, rel=1e-6)
    assert metrics["critic/vf_clip_frac"] == pytest.approx(1 / 3)
    assert metrics["critic/value_mean"] == pytest.approx(3.5 / 3, rel=1e-6)
    loss.backward()
    # (v - R) / 3 on the unclipped branch
    close(values.grad, [[-1 / 3, 0.0, 0.5 / 3, 0.0]])
    assert old.grad is None and returns.grad is None


def test_value_loss_gradcheck_float64():
    values = t([[1.0, 2.0, 0.5, 0.3], [0.0, -1.0, 4.0, 2.0]], grad=True)
    old = t([[0.9, 1.0, 0.6, 0.0], [0.5, -1.1, 3.0, 2.0]])
    returns = t([[2.0, 2.5, 0.0, 1.0], [1.0, 0.0, 4.1, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old, returns, mask, clip=0.2)[0], (values,))


# ---------------------------------------------------------------- KL as reward / as loss


def test_kl_penalty_rewards_hand_values():
    # k1 = logp - ref = [0.5, 0, (-0.5 masked)], coef 0.1 -> [-0.05, 0, 1 unchanged]
    logp = t([[-1.0, -1.0, -1.0]], grad=True)
    out = kl_penalty_rewards(t([[0.0, 0.0, 1.0]]), logp, t([[-1.5, -1.0, -0.5]]), torch.tensor([[1, 1, 0]]), coef=0.1)
    close(out, [[-0.05, 0.0, 1.0]])
    assert not out.requires_grad
    out_k2 = kl_penalty_rewards(t([[0.0, 0.0, 1.0]]), logp, t([[-1.5, -1.0, -0.5]]), torch.ones(1, 3), coef=0.1, kind="k2")
    close(out_k2, [[-0.0125, 0.0, 1.0 - 0.0125]])


def test_kl_loss_term_hand_values_grad_and_gradcheck():
    # k3 with x = ref - logp = [-0.5, 0.5]: [0.1065307, 0.1487213], mean 0.1276260, coef 0.5
    logp = t([[0.0, -1.0]], grad=True)
    ref = t([[-0.5, -0.5]], grad=True)
    loss, metrics = kl_loss_term(logp, ref, torch.ones(1, 2), coef=0.5)
    assert loss.item() == pytest.approx(0.5 * 0.1276260, rel=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(0.1276260, rel=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - e^x; times coef / 2 tokens
    close(logp.grad, [[0.25 * (1 - math.exp(-0.5)), 0.25 * (1 - math.exp(0.5))]])
    assert ref.grad is None
    lp = t([[0.0, -1.0, 0.3], [0.2, -0.7, 1.0]], grad=True)
    ref2 = t([[-0.5, -0.5, 0.0], [0.1, 0.0, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    for kind in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x: kl_loss_term(x, ref2, mask, coef=0.3, kind=kind, agg="seq-mean-token-mean")[0], (lp,))


# ---------------------------------------------------------------- numerical robustness


@pytest.mark.parametrize("dtype", DTYPES)
def test_kl_and_value_extremes_stay_finite(dtype):
    logp = t([[1000.0, -1000.0]], dtype, grad=True)
    loss, _ = kl_loss_term(logp, t([[-1000.0, 1000.0]], dtype), torch.ones(1, 2), coef=0.1, kind="k3")
    loss.backward()
    assert loss.item() == pytest.approx(0.1 * 10.0) and torch.isfinite(logp.grad).all()
    v = t([[1e4, -1e4]], dtype, grad=True)
    vl, _ = value_loss(v, t([[0.0, 0.0]], dtype), t([[-1e4, 1e4]], dtype), torch.ones(1, 2))
    vl.backward()
    assert torch.isfinite(vl) and torch.isfinite(v.grad).all()
