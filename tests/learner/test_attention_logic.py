"""Pure logic of the fused attention: the zig-zag CP split, the segment plan, and config errors.

Every segment plan is checked against the mask it stands for: for each local query, the keys its
segment lets it see are exactly the causal keys of its own document (no S x S mask is built by the
module; here one is built only to check the plan)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import LearnerConfig
from asyncrl.learner.attention import DocLayout, local_positions, plan_segments, split_for_cp


def _visible(width: int, cp: int, rank: int, bounds) -> list[set[int]]:
    """Per local query: the global keys its segment covers, causally aligned at the bottom right."""
    vis: list[set[int]] = [set() for _ in range(width // cp)]
    for s in plan_segments(width, cp, rank, bounds):
        q_len, k_len = s.q_end - s.q_start, s.k_end - s.k_start
        for i in range(q_len):
            vis[s.q_start + i] = set(range(s.k_start, s.k_start + k_len - q_len + i + 1))
    return vis


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("bounds", [None, (0, 5, 6, 13, 16), (0, 16), (0, 1, 16)])
def test_segments_cover_each_query_with_its_documents_causal_keys(cp, bounds):
    width = 16
    doc = [0] * width
    for d, (a, b) in enumerate(zip(bounds or (0, width), (bounds or (0, width))[1:])):
        doc[a:b] = [d] * (b - a)
    for rank in range(cp):
        positions = local_positions(width, cp, rank)
        vis = _visible(width, cp, rank, bounds)
        for local, q in enumerate(positions):
            assert vis[local] == {k for k in range(q + 1) if doc[k] == doc[q]}, (cp, rank, local)


def test_zigzag_split_balances_and_reassembles():
    t = torch.arange(2 * 16).view(2, 16)
    parts = [split_for_cp(t, 4, r) for r in range(4)]
    assert [p.shape for p in parts] == [torch.Size([2, 4])] * 4
    assert parts[0][0].tolist() == [0, 1, 14, 15]  # chunk 0 and chunk 7: early + late
    cols = sorted(c for r in range(4) for c in local_positions(16, 4, r))
    assert cols == list(range(16))


def test_bad_widths_and_bounds_name_the_value():
    with pytest.raises(ValueError, match="not divisible by 2 \\* context_parallel_size=4"):
        plan_segments(10, 2, 0)
    with pytest.raises(ValueError, match="must rise strictly from 0 to the row width 8"):
        plan_segments(8, 1, 0, (0, 4, 4, 8))
    with pytest.raises(ValueError, match="do not fit a row of 5"):
        DocLayout.for_row([3, 3], 5)
    assert DocLayout.for_row([3, 2], 8).bounds == (0, 3, 5, 8)  # the pad after the last document


@pytest.mark.parametrize("strategy,kw,match", [
    ({"tensor_model_parallel_size": 1, "sequence_parallel": True}, {}, "sequence_parallel=True needs tensor_model_parallel_size > 1"),
    ({"context_parallel_size": 2}, {"attention": "local"}, "context_parallel_size=2 needs learner.attention"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True}, {"attention": "local"}, "sequence_parallel=True needs learner.attention"),
    ({"tensor_model_parallel_size": 2, "tp_comm_overlap": True}, {}, "tp_comm_overlap=True needs sequence_parallel=True"),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": True, "tp_comm_overlap": True}, {"attention": "te"},
     "tp_comm_overlap=True needs learner.attention 'sdpa'"),
])
def test_config_errors_name_the_field(strategy, kw, match):
    ws = strategy.get("tensor_model_parallel_size", 1) * strategy.get("context_parallel_size", 1)
    with pytest.raises(ValueError, match=match):
        LearnerConfig(world_size=ws, strategy_config=strategy, **kw)


def _reference(q, k, v, width, cp, rank, bounds, scale=0.125):
    """One rank's attention through an explicit mask: each local query sees its document's causal keys."""
    doc = torch.zeros(width, dtype=torch.long)
    for d, (a, b) in enumerate(zip(bounds or (0, width), (bounds or (0, width))[1:])):
        doc[a:b] = d
    pos = torch.tensor(local_positions(width, cp, rank))
    keys = torch.arange(width)
    mask = (keys[None, :] <= pos[:, None]) & (doc[keys][None, :] == doc[pos][:, None])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device), scale=scale,
                                                            enable_gqa=True)


@pytest.mark.parametrize("cp,bounds", [(1, None), (2, None), (2, (0, 5, 13, 16)), (4, (0, 1, 9, 16))])
def test_segments_attend_as_the_document_causal_mask_grouped_heads(cp, bounds):
    """`attend_segments` (square causal calls and bottom-right ones) equals the masked attention, outputs and the
    gradients of queries, keys and values, with grouped-query heads (4 query heads on 2 K/V heads)."""
    from asyncrl.learner.attention import attend_segments

    width, g = 16, torch.Generator().manual_seed(0)
    q_all = torch.randn(1, 4, width, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, width, 64, generator=g, dtype=torch.float64) for _ in range(2))
    for rank in range(cp):
        grads = []
        for fn in (lambda a, b, c: attend_segments(a, b, c, plan_segments(width, cp, rank, bounds), 0.125),
                   lambda a, b, c: _reference(a, b, c, width, cp, rank, bounds)):
            x, y, z = (t.detach().clone().requires_grad_() for t in (split_for_cp(q_all, cp, rank, dim=2), k, v))
            out = fn(x, y, z)
            out.pow(2).sum().backward()
            grads.append([out, x.grad, y.grad, z.grad])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)


def _math_forward(q, k, v, causal, scale):
    """A fused call's contract, in plain torch (float64): output, log-sum-exp [b, h, sq, 1], nothing saved."""
    r = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(r, 1).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1, keepdim=True)
    return (scores - lse).exp() @ v.repeat_interleave(r, 1), lse, None


def _math_backward(dout, q, k, v, out, lse, causal, scale, _saved):
    """A fused call's backward from the given output and log-sum-exp (the merged ones, in `_MergedLowerRight`)."""
    r = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    scores = q @ ke.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = (scores - lse).exp()
    ds = p * (dout @ ve.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    fold = lambda t: t.view(t.shape[0], k.shape[1], r, *t.shape[2:]).sum(2)  # noqa: E731
    return ds @ ke * scale, fold(ds.transpose(-1, -2) @ q * scale), fold(p.transpose(-1, -2) @ dout)


@pytest.mark.parametrize("sq,sk", [(4, 16), (7, 8), (8, 24)])
def test_merged_lower_right_equals_the_masked_call_with_its_gradients(sq, sk):
    """The split-and-merge of a bottom-right causal call (its forward and backward, `_MergedLowerRight`) against
    SDPA with the `causal_lower_right` bias: outputs and the gradients of queries, keys and values (GQA 4 on 2)."""
    from torch.nn.attention.bias import causal_lower_right

    from asyncrl.learner.attention import _MergedLowerRight

    g = torch.Generator().manual_seed(1)
    q0 = torch.randn(2, 4, sq, 8, generator=g, dtype=torch.float64)
    k0, v0 = (torch.randn(2, 2, sk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, 4, sq, 8, generator=g, dtype=torch.float64)
    results = []
    for fn in (lambda a, b, c: _MergedLowerRight.apply(a, b, c, 0.3, (_math_forward, _math_backward)),
               lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
                   a, b, c, attn_mask=causal_lower_right(sq, sk), scale=0.3, enable_gqa=True)):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = fn(q, k, v)
        out.backward(dout)
        results.append([out, q.grad, k.grad, v.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
