"""The learner's attention on a GPU: a CP rank's bottom-right causal segments (its late chunk, a document begun in an
earlier chunk) through cuDNN's kernels, split and merged (issue 67: CP on the fused path for every segment shape),
agree with the masked attention in fp32. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from asyncrl.learner.attention import attend_segments, cudnn_lower_right_ok, plan_segments, split_for_cp
from tests.learner.test_attention_logic import _reference

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("cp,bounds", [(2, None), (2, (0, 700, 2048)), (4, None)])
@pytest.mark.parametrize("split", [True, False])
def test_late_segments_match_the_mask(cp, bounds, split, monkeypatch):
    """bf16 (the [s, b, h, d] -> [b, h, s, d] views the module passes) against the fp32 masked attention, with the
    3B's heads (16 on 2 K/V heads of 128); outputs and gradients within 1 % by norm. `split`: the segments (of 256 to
    1,024 queries here) take the merged cuDNN path, else the one call with SDPA's bias."""
    from asyncrl.learner import attention

    monkeypatch.setattr(attention, "MERGE_MIN_QUERIES", 0 if split else 1 << 30)
    width, scale, g = 2048, 128 ** -0.5, torch.Generator(device="cuda").manual_seed(0)
    q_all = torch.randn(width, 1, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(width, 1, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    for rank in range(cp):
        segments = plan_segments(width, cp, rank, bounds)
        late = next(s for s in segments if not s.square)
        if torch.cuda.get_device_capability() >= (9, 0):
            assert cudnn_lower_right_ok(q_all.permute(1, 2, 0, 3)[:, :, late.q_start : late.q_end],
                                        k.permute(1, 2, 0, 3)[:, :, late.k_start : late.k_end])
        results = []
        for dtype, fn in ((torch.bfloat16, lambda a, b, c: attend_segments(a, b, c, segments, scale)),
                          (torch.float32, lambda a, b, c: _reference(a, b, c, width, cp, rank, bounds, scale))):
            x, y, z = (t.detach().to(dtype).requires_grad_() for t in (split_for_cp(q_all, cp, rank, dim=0), k, v))
            out = fn(*(t.permute(1, 2, 0, 3) for t in (x, y, z)))
            out.float().pow(2).sum().backward()
            results.append([t.float() for t in (out, x.grad, y.grad, z.grad)])
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            assert float((a - b).norm() / b.norm()) < 1e-2, (rank, name, float((a - b).norm() / b.norm()))
