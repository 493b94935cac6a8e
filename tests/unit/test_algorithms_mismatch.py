"""The engine/learner mismatch metrics (asyncrl/algorithms/mismatch.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.mismatch import combine_mismatch_sums, mismatch_metrics, mismatch_sums


def _case():
    # two rows; d = prox - behave is [0.0, 1.0, -1.0 | 0.5, pad]: the pad (mask 0) holds garbage
    behave = torch.tensor([[-1.0, -2.0, -1.0], [-3.0, float("nan"), 0.0]])
    prox = torch.tensor([[-1.0, -1.0, -2.0], [-2.5, float("-inf"), 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    gaps = torch.tensor([[0, 1, 2], [3, 0, 0]])
    return prox, behave, mask, gaps


def test_metrics_over_all_tokens_and_by_version_gap():
    prox, behave, mask, gaps = _case()
    m = mismatch_metrics(mismatch_sums(prox, behave, mask, gaps))
    d = [0.0, 1.0, -1.0, 0.5]
    assert m["mismatch/tokens"] == 4
    assert m["mismatch/k1"] == pytest.approx(-sum(d) / 4)
    assert m["mismatch/k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    assert m["mismatch/abs_diff_mean"] == pytest.approx(2.5 / 4)
    assert m["mismatch/abs_diff_max"] == pytest.approx(1.0)
    assert m["mismatch/ppl_behavior"] == pytest.approx(math.exp((1 + 2 + 1 + 3) / 4))
    assert m["mismatch/ppl_proximal"] == pytest.approx(math.exp((1 + 1 + 2 + 2.5) / 4))
    assert m["mismatch/ppl_ratio"] == pytest.approx(math.exp((6.5 - 7) / 4))
    assert m["mismatch/out_of_band_frac"] == pytest.approx(2 / 4)  # |d| = 1 > log 2 twice
    # gap 0: the first token; gap 1: the second; 2+: the third and the fourth (gap 3)
    assert m["mismatch/gap0/tokens"] == 1 and m["mismatch/gap0/abs_diff_max"] == 0.0
    assert m["mismatch/gap1/k1"] == pytest.approx(-1.0)
    assert m["mismatch/gap2+/tokens"] == 2
    assert m["mismatch/gap2+/abs_diff_mean"] == pytest.approx(0.75)
    assert m["mismatch/gap2+/abs_diff_max"] == pytest.approx(1.0)
    assert all(math.isfinite(v) for v in m.values())  # the masked -inf never reaches a sum


def test_parts_combine_to_the_whole_and_empty_buckets_are_left_out():
    prox, behave, mask, gaps = _case()
    whole = mismatch_sums(prox, behave, mask, gaps)
    parts = [mismatch_sums(prox[i : i + 1], behave[i : i + 1], mask[i : i + 1], gaps[i : i + 1]) for i in range(2)]
    assert torch.allclose(combine_mismatch_sums(parts), whole)
    no_gaps = mismatch_metrics(mismatch_sums(prox, behave, mask))
    assert "mismatch/k3" in no_gaps and not any("/gap" in k for k in no_gaps)
    assert mismatch_metrics(combine_mismatch_sums([])) == {}


def test_the_same_policy_has_no_mismatch():
    lp = torch.log_softmax(torch.randn(3, 5, 7), -1)[..., 0]
    m = mismatch_metrics(mismatch_sums(lp, lp.clone(), torch.ones(3, 5)))
    assert m["mismatch/k3"] == 0.0 and m["mismatch/abs_diff_max"] == 0.0 and m["mismatch/ppl_ratio"] == 1.0


def test_k3_reads_the_gap_at_float32s_floor():
    """Two float32 log-probs a few ulps apart (the fp32 engine against the learner: d ~ 1e-6): k3 is ~d^2 / 2,
    1e-13, not the ~1e-9 that exp(d) - 1 - d in float32 reads whatever d is."""
    torch.manual_seed(0)
    behave = -torch.rand(64, 128) * 5
    d32 = torch.randn(64, 128) * 1e-6
    prox = (behave.double() + d32.double()).float()  # the nearest float32: the gap as float32 holds it
    d = prox.double() - behave.double()
    want = float(((d.exp() - 1 - d).sum() / d.numel()))  # float64 reference
    m = mismatch_metrics(mismatch_sums(prox, behave, torch.ones(64, 128)))
    assert 1e-14 < m["mismatch/k3"] < 1e-11 and m["mismatch/k3"] == pytest.approx(want, rel=1e-3)
    assert m["mismatch/abs_diff_max"] == pytest.approx(float(d.abs().max()), rel=1e-9)
