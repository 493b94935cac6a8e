"""learner/lora.py's two adapter paths agree: the merged-weight linear (no dropout, `_MergedLinear`) and the forward
hook's `add_to` (dropout > 0, here in eval mode where dropout is the identity), on one TP rank in float64: outputs,
the input's gradient and every adapter's. The Megatron equality with PEFT (tests/learner/test_megatron_layouts.py)
runs the merged path only. Inside `hold_merged` (a pass over a step's micro-batches) the merged weight is built once
and reused, and gone after it: a later change of the adapters reaches the output. An input that needs no gradient
gets none; the adapters' gradients are the same."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.lora import LinearAdapters, hold_merged


@pytest.mark.parametrize("held", [False, True], ids=["rebuilt", "held"])
@pytest.mark.parametrize("slot, parts, rows, in_features", [
    ("linear_qkv", {"q_proj": 8, "k_proj": 4, "v_proj": 4}, 16, 12),
    ("linear_fc1", {"gate_proj": 10, "up_proj": 10}, 20, 12),
    ("linear_fc1", {"up_proj": 10}, 20, 12),  # one part of a fused linear targeted: the other's rows untouched
    ("linear_qkv", {"k_proj": 4}, 16, 12),
    ("linear_fc2", {"down_proj": 12}, 12, 10),
])
def test_the_merged_linear_equals_the_hooks_output_and_gradients(slot, parts, rows, in_features, held):
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
        adapters.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = forward(adapters, xi)
        y.backward(grad)
        return y.detach(), xi.grad, {f"{k}.{p}": t.grad for k in ("A", "B") for p, t in getattr(adapters, k).items()}

    with hold_merged([merged] if held else []):
        y1, gx1, g1 = run(merged, lambda a, xi: a.linear(xi, weight, bias, None))
        if held:  # a second micro-batch: the same merged weight, not another
            kept = dict(merged.held)
            assert len(kept) == 1
            y1b, _, g1b = run(merged, lambda a, xi: a.linear(xi, weight, bias, None))
            assert merged.held == kept and torch.equal(y1b, y1)
            torch.testing.assert_close(g1b, g1)
    assert merged.held is None
    y2, gx2, g2 = run(hooked, lambda a, xi: a.add_to(xi @ weight.t() + bias, xi))
    torch.testing.assert_close(y1, y2)
    torch.testing.assert_close(gx1, gx2)
    assert g1.keys() == g2.keys() and all(g1[k] is not None for k in g1)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], msg=k)
    # an input that needs no gradient (the first adapted linear's: embeddings and norms frozen): none computed for
    # it, the adapters' all the same
    merged.zero_grad(set_to_none=True)
    merged.linear(x, weight, bias, None).backward(grad)
    for k, t in (("A", merged.A), ("B", merged.B)):
        for p in t:
            torch.testing.assert_close(t[p].grad, g2[f"{k}.{p}"], msg=f"{k}.{p}")
    with torch.no_grad():  # the logprob pass: the merged weight alone
        torch.testing.assert_close(merged.linear(x, weight, bias, None), y1)
    with torch.no_grad():  # after the pass the adapters change (the optimizer's step): the output follows
        for p in merged.B:
            merged.B[p].mul_(2)
            hooked.B[p].mul_(2)
        torch.testing.assert_close(merged.linear(x, weight, bias, None), hooked.add_to(x @ weight.t() + bias, x))
