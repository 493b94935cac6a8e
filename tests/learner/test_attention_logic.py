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
])
def test_config_errors_name_the_field(strategy, kw, match):
    ws = strategy.get("tensor_model_parallel_size", 1) * strategy.get("context_parallel_size", 1)
    with pytest.raises(ValueError, match=match):
        LearnerConfig(world_size=ws, strategy_config=strategy, **kw)
