"""The learner's GPU fusions (asyncrl/learner/gpu_fusions.py, the LM head's float32 main_grad sink).

CPU: the fused RoPE's forward and backward math (the eager functions the GPU compiles) against
Megatron's unfused RoPE, and that nothing switches on without CUDA. GPU (marked, skipped without
CUDA): the compiled RoPE in bf16, the LM head's wgrad written straight into `main_grad`, and
torch's fused Adam under a Megatron-style optimizer giving foreach's update.
"""

from __future__ import annotations

import types

import pytest
import torch

from asyncrl.learner import gpu_fusions


def _freqs(s: int, d: int, device: str = "cpu") -> torch.Tensor:
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device).float() / d))
    f = torch.outer(torch.arange(s, device=device).float(), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]  # Megatron's RotaryEmbedding layout


@pytest.mark.parametrize("rot_dim", [32, 16])  # whole head dim, and partial rotary (t_pass kept)
def test_fused_rope_matches_megatron_unfused(rot_dim):
    from megatron.core.models.common.embeddings import rope_utils

    torch.manual_seed(0)
    s, b, h, d = 12, 2, 3, 32
    # a non-contiguous [s, b, h, d] view, like Megatron's q split out of the fused QKV projection
    qkv = torch.randn(s, b, h, 2 * d, dtype=torch.float64)
    x = qkv[..., :d].requires_grad_(False).clone().requires_grad_(True)
    view = torch.cat([x, x], dim=-1)[..., :d]
    freqs = _freqs(s, rot_dim).double()
    grad = torch.randn(s, b, h, d, dtype=torch.float64)
    want = rope_utils._apply_rotary_pos_emb_bshd(view, freqs)
    (want_grad,) = torch.autograd.grad(want, x, grad)
    got = gpu_fusions.fused_rope(view, freqs.float())
    (got_grad,) = torch.autograd.grad(got, x, grad)
    assert got.dtype == view.dtype and got.shape == view.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-6)
    if rot_dim < d:  # the pass-through half is untouched, forward and backward
        assert torch.equal(got[..., rot_dim:], view[..., rot_dim:])
        assert torch.equal(got_grad[..., rot_dim:], grad[..., rot_dim:])


def test_fused_rope_refuses_interleaved():
    with pytest.raises(ValueError, match="interleaved"):
        gpu_fusions.fused_rope(torch.zeros(2, 1, 1, 4), _freqs(2, 4), interleaved=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side of the switch")
def test_nothing_switches_on_without_cuda():
    assert gpu_fusions.install_rope_fusion() is False
    assert gpu_fusions.fused_wgrad_accumulation() is None
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    assert gpu_fusions.use_fused_adam(types.SimpleNamespace(optimizer=opt)) is False
    assert opt.param_groups[0]["fused"] is None


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_compiled_rope_on_gpu_matches_unfused_in_bf16():
    from megatron.core.models.common.embeddings import rope_utils

    assert gpu_fusions.install_rope_fusion()
    assert rope_utils.fused_apply_rotary_pos_emb is not None
    torch.manual_seed(0)
    for s, b in ((64, 1), (96, 2)):  # dynamic shapes: one compile serves both
        x = torch.randn(s, b, 4, 2 * 64, device="cuda", dtype=torch.bfloat16)[..., :64].requires_grad_(True)
        freqs = _freqs(s, 64, "cuda")
        grad = torch.randn(s, b, 4, 64, device="cuda", dtype=torch.bfloat16)
        ref_x = x.detach().float().requires_grad_(True)
        want = rope_utils._apply_rotary_pos_emb_bshd(ref_x, freqs)
        (want_grad,) = torch.autograd.grad(want, ref_x, grad.float())
        got = rope_utils.fused_apply_rotary_pos_emb(x, freqs)
        (got_grad,) = torch.autograd.grad(got, x, grad)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got_grad.float(), want_grad, rtol=1e-2, atol=1e-2)


@pytest.fixture
def one_rank_model_parallel(tmp_path):
    from megatron.core import parallel_state as ps

    torch.distributed.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0)
    ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 1000])  # several chunks, and one
def test_lm_head_wgrad_goes_straight_into_main_grad(one_rank_model_parallel, chunk):
    """bf16 weights with a float32 main_grad: the LM head's weight gradient is added there (onto
    what is there), nothing comes back through .grad, and it matches a float32 computation."""
    from asyncrl.learner.lm_head import linear_logprobs

    assert gpu_fusions.install_wgrad_fusion()
    torch.manual_seed(0)
    n, hdim, vocab = 200, 64, 512
    hidden = torch.randn(n, hdim, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, vocab - 12, (n,), device="cuda")
    up = torch.randn(n, device="cuda")
    w0 = torch.randn(vocab, hdim, device="cuda", dtype=torch.bfloat16) * 0.05

    def run(weight, h, ch):
        lp, _ = linear_logprobs(h, weight, labels, temperature=0.7, real_vocab=vocab - 12, chunk=ch,
                                with_entropy=False)
        (lp * up).sum().backward()

    ref = torch.nn.Parameter(w0.float())  # float32 everywhere, one chunk: the reference
    run(ref, hidden.float(), n)
    ddp = torch.nn.Parameter(w0.clone())
    ddp.main_grad = torch.full((vocab, hdim), 0.5, device="cuda")
    run(ddp, hidden.clone().requires_grad_(True), chunk)
    assert ddp.grad is None  # nothing went through .grad: DDP's hook has nothing to add twice
    got = ddp.main_grad - 0.5
    # bf16 logits in the forward; the accumulation itself is float32 (CPU simulation: 0.26 %)
    assert (got - ref.grad).abs().max() <= 1e-2 * ref.grad.abs().max()


@pytest.mark.gpu
def test_fused_adam_gives_foreach_update():
    torch.manual_seed(0)
    params = [torch.randn(1000, device="cuda"), torch.randn(37, 5, device="cuda")]
    grads = [[torch.randn_like(p) for p in params] for _ in range(3)]
    result = []
    for fused in (False, True):
        ps = [torch.nn.Parameter(p.clone()) for p in params]
        opt = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
        wrapper = types.SimpleNamespace(optimizer=opt)
        if fused:
            assert gpu_fusions.use_fused_adam(wrapper)
            assert opt.param_groups[0]["fused"] is True
        for gs in grads:
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            opt.step()
        result.append([p.detach() for p in ps])
    for a, b in zip(*result):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_lm_head_triton_kernels_match_the_torch_path():
    """One-pass row statistics (also split over two 'TP ranks' and combined) and the in-place
    logits gradient against lm_head's torch functions, with vocab padding and off-rank labels."""
    from asyncrl.learner import lm_head
    from asyncrl.learner import lm_head_kernels as k

    torch.manual_seed(0)
    c, vocab, limit, inv_t = 37, 10_000, 9_990, 1 / 0.7
    x = (torch.randn(c, vocab, device="cuda") * 4).bfloat16()
    label = torch.randint(0, limit, (c,), device="cuda")
    label[::5] = -1  # on another rank
    in_range = label >= 0
    safe = torch.where(in_range, label, 0)
    assert k.available(x)
    m_ref = lm_head._row_max(x, inv_t, limit)
    stats_ref = lm_head._row_stats(x, m_ref, safe, in_range, inv_t, limit)
    m, s0, s1, xl = k.row_stats(x, label, inv_t, limit)
    torch.testing.assert_close(m, m_ref)
    torch.testing.assert_close(s0, stats_ref[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(s1, stats_ref[1], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(torch.where(in_range, xl - m, 0.0), stats_ref[2])
    # two ranks of 5,000 columns each (the second holds the 10 padding columns), combined
    halves = [k.row_stats(x[:, :5000].contiguous(), label, inv_t, 5000),
              k.row_stats(x[:, 5000:].contiguous(), label - 5000, inv_t, limit - 5000)]
    big_m = torch.maximum(halves[0][0], halves[1][0])
    parts = [k.combine(h[0], h[1], h[2], big_m) for h in halves]
    torch.testing.assert_close(big_m, m_ref)
    torch.testing.assert_close(parts[0][0] + parts[1][0], stats_ref[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(parts[0][1] + parts[1][1], stats_ref[1], rtol=1e-4, atol=1e-3)
    lse = m_ref + stats_ref[0].log()
    grad = torch.randn(c, device="cuda")
    want = lm_head._grad_logits(x, lse, grad, safe, in_range, inv_t, limit)
    got = k.grad_logits_(x.clone(), lse, grad, label, inv_t, limit)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
    assert torch.all(got[:, limit:] == 0)  # padding columns carry no probability, no gradient
