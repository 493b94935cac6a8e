"""learner/lora.py's two adapter paths agree: the merged-weight linear (no dropout, `_MergedLinear`) and the forward
hook's `add_to` (dropout > 0, here in eval mode where dropout is the identity), on one TP rank in float64: outputs,
the input's gradient and every adapter's. The Megatron equality with PEFT (tests/learner/test_megatron_layouts.py)
runs the merged path only."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.lora import LinearAdapters


@pytest.mark.parametrize("slot, parts, rows, in_features", [
    ("linear_qkv", {"q_proj": 8, "k_proj": 4, "v_proj": 4}, 16, 12),
    ("linear_fc1", {"gate_proj": 10, "up_proj": 10}, 20, 12),
    ("linear_fc1", {"up_proj": 10}, 20, 12),  # one part of a fused linear targeted: the other's rows untouched
    ("linear_fc2", {"down_proj": 12}, 12, 10),
])
def test_the_merged_linear_equals_the_hooks_output_and_gradients(slot, parts, rows, in_features):
    torch.manual_seed(0)
    make = lambda dropout: LinearAdapters(  # noqa: E731
        slot, parts, in_features, rank=3, alpha=6.0, dropout=dropout, tp_rank=0, tp_size=1,
        layout=(2, 2, 2), generator=torch.Generator().manual_seed(1), dtype=torch.float64, device=torch.device("cpu"))
    merged, hooked = make(0.0), make(0.1).eval()
    with torch.no_grad():
        for p in merged.B:
            merged.B[p].normal_()
            hooked.B[p].copy_(merged.B[p])
    assert all(torch.equal(merged.A[p], hooked.A[p]) for p in merged.A)
    weight = torch.randn(rows, in_features, dtype=torch.float64)
    bias = torch.randn(rows, dtype=torch.float64)
    x = torch.randn(5, 2, in_features, dtype=torch.float64)
    grad = torch.randn(5, 2, rows, dtype=torch.float64)

    def run(adapters, forward):
        xi = x.clone().requires_grad_()
        y = forward(adapters, xi)
        y.backward(grad)
        return y.detach(), xi.grad, {f"{k}.{p}": t.grad for k in ("A", "B") for p, t in getattr(adapters, k).items()}

    y1, gx1, g1 = run(merged, lambda a, xi: a.linear(xi, weight, bias, None))
    y2, gx2, g2 = run(hooked, lambda a, xi: a.add_to(xi @ weight.t() + bias, xi))
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(gx1, gx2)
    assert g1.keys() == g2.keys() and all(g1[k] is not None for k in g1)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], msg=k)
    with torch.no_grad():  # the logprob pass: the merged weight alone
        torch.testing.assert_close(merged.linear(x, weight, bias, None), y1)


def _adapters(slot, parts, in_features, *, dropout=0.0, base_fp8=False, dtype=torch.float32):
    return LinearAdapters(slot, parts, in_features, rank=4, alpha=8.0, dropout=dropout, tp_rank=0, tp_size=1,
                          layout=(2, 2, 8), generator=torch.Generator().manual_seed(1), dtype=dtype,
                          device=torch.device("cpu"), base_fp8=base_fp8)


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def test_quantize_rows_scales_each_row_to_e4m3_and_pads_to_sixteen_rows():
    from asyncrl.learner.lora_fp8 import E4M3, E4M3_MAX, quantize_rows

    x = torch.randn(21, 48, dtype=torch.bfloat16) * torch.logspace(-3, 3, 21).to(torch.bfloat16)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and q.shape == (32, 48) and scale.shape == (32, 1) and scale.dtype == torch.float32
    back = q[:21].float() * scale[:21]
    assert _rel(back, x.float()) < 0.04  # e4m3: 3 mantissa bits, every row at its own scale
    assert float(q[:21].float().abs().amax(dim=1).min()) == E4M3_MAX  # each row's largest lands on e4m3's largest
    assert not q[21:].float().any() and torch.equal(scale[21:], torch.ones(11, 1))  # padding rows
    assert torch.isfinite(q.float()).all()


def test_the_fp8_weight_is_rebuilt_when_the_weight_changes_and_freed_by_drop():
    from asyncrl.learner.lora_fp8 import Fp8Weight

    w = torch.randn(32, 48)
    w8 = Fp8Weight().of(w)
    fwd = w8.fwd
    assert w8.of(w).fwd is fwd  # kept while the weight stands
    torch.testing.assert_close(w8.fwd.float() * w8.fwd_scale.t(), w, rtol=0.07, atol=0)
    torch.testing.assert_close(w8.bwd.t().float() * w8.bwd_scale, w, rtol=0.07, atol=0)
    with torch.no_grad():
        w.mul_(2)  # (a checkpoint load: the version moves)
    assert w8.of(w).fwd is not fwd
    torch.testing.assert_close(w8.fwd.float() * w8.fwd_scale.t(), w, rtol=0.07, atol=0)
    w8.drop()
    assert w8.fwd is None and w8.bwd is None


@pytest.mark.parametrize("slot, parts, rows, in_features", [
    ("linear_qkv", {"q_proj": 32, "k_proj": 16, "v_proj": 16}, 64, 48),
    ("linear_fc1", {"up_proj": 40}, 80, 48),
    ("linear_fc2", {"down_proj": 48}, 48, 80),
])
def test_the_fp8_base_linear_is_the_merged_one_within_fp8_and_its_adapter_gradients_equal_it(slot, parts, rows,
                                                                                             in_features):
    """learner.lora.base_fp8: the output and the input's gradient equal the merged linear's to FP8's rounding (and
    differ from it: the base really ran in e4m3); the adapters' gradients do not read W, so they equal it."""
    torch.manual_seed(0)
    merged, fp8 = _adapters(slot, parts, in_features), _adapters(slot, parts, in_features, base_fp8=True)
    with torch.no_grad():
        for p in merged.B:
            merged.B[p].normal_(std=0.05)
            fp8.B[p].copy_(merged.B[p])
    weight = torch.randn(rows, in_features) * 0.1
    bias = torch.randn(rows)
    x = torch.randn(7, 3, in_features)  # 21 rows: padded to 32 inside
    grad = torch.randn(7, 3, rows)

    def run(adapters):
        xi = x.clone().requires_grad_()
        y = adapters.linear(xi, weight, bias, None)
        y.backward(grad)
        return y.detach(), xi.grad, {f"{k}.{p}": t.grad for k in ("A", "B") for p, t in getattr(adapters, k).items()}

    y1, gx1, g1 = run(merged)
    y2, gx2, g2 = run(fp8)
    assert 1e-4 < _rel(y2, y1) < 0.05 and 1e-4 < _rel(gx2, gx1) < 0.05
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], msg=k)
    with torch.no_grad():  # the log-prob pass: the same forward
        torch.testing.assert_close(fp8.linear(x, weight, bias, None), y2)


def test_the_fp8_base_linear_with_dropout_gives_the_adapters_the_dropped_input():
    """With dropout the adapters read dropout(x) (the same mask as the hook path's for the same seed) and the input's
    gradient comes back through both the base and the mask."""
    torch.manual_seed(0)
    parts, rows, in_features = {"down_proj": 48}, 48, 80
    hooked = _adapters("linear_fc2", parts, in_features, dropout=0.5)
    fp8 = _adapters("linear_fc2", parts, in_features, dropout=0.5, base_fp8=True)
    with torch.no_grad():
        hooked.B["down_proj"].normal_(std=0.05)
        fp8.B["down_proj"].copy_(hooked.B["down_proj"])
    weight, x, grad = torch.randn(rows, in_features) * 0.1, torch.randn(5, 4, in_features), torch.randn(5, 4, rows)

    def run(adapters, forward):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        y = forward(adapters, xi)
        y.backward(grad)
        return y.detach(), xi.grad, {k: t.grad for k in ("A", "B") for t in getattr(adapters, k).values()}

    y1, gx1, g1 = run(hooked, lambda a, xi: a.add_to(xi @ weight.t(), xi))
    y2, gx2, g2 = run(fp8, lambda a, xi: a.linear(xi, weight, None, None))
    assert _rel(y2, y1) < 0.05 and _rel(gx2, gx1) < 0.05
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], msg=k)
    fp8.eval()  # no dropout outside training: the adapters read x itself
    y3 = fp8.linear(x, weight, None, None)
    assert _rel(y3, y2) > 1e-3
