"""Triton kernels for the LM head's vocab-wide passes (`lm_head.linear_logprobs`), CUDA only.

Owns: `row_stats` (one pass over a chunk's logits: the online-softmax running max, sum of exp and sum of exp times
logit, plus the label's logit), `grad_logits_` (the logits' gradient written over the logits themselves),
`available(x)` (when they apply) and `combine` (the same statistics merged across TP ranks).
Why: the torch versions (which CPU runs) read the chunk twice in the forward and ran well below memory bandwidth.
Must never: read the device from the host, or hand back a different answer than the torch path (the GPU test
compares them).
Details: docs/design/learner.md, "LM head kernels".
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU machines: the torch path runs
    triton = None

MASKED_LOGIT = -1e30  # == lm_head.MASKED_LOGIT (finite, so exp(.) * (x - m) stays 0)


def available(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and x.stride(-1) == 1


if triton is not None:
    _MASKED = tl.constexpr(MASKED_LOGIT)

    @triton.jit
    def _row_stats_kernel(x_ptr, stride, label_ptr, m_ptr, s0_ptr, s1_ptr, xl_ptr, n_cols, limit, inv_t,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride
        m = tl.max(tl.full((BLOCK,), _MASKED, tl.float32), 0)  # float32 scalars carried by the loop
        s0 = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
        s1 = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32) * inv_t
            x = tl.where(cols < limit, x, _MASKED)
            x = tl.where(cols < n_cols, x, float("-inf"))  # past the row: no mass at all
            m_new = tl.maximum(m, tl.max(x, 0))
            a = tl.exp(m - m_new)
            y = x - m_new
            e = tl.where(cols < n_cols, tl.exp(y), 0.0)
            s1 = a * (s1 + (m - m_new) * s0) + tl.sum(tl.where(cols < n_cols, e * y, 0.0), 0)
            s0 = a * s0 + tl.sum(e, 0)
            m = m_new
        label = tl.load(label_ptr + row)
        ok = (label >= 0) & (label < n_cols)
        xl = tl.load(base + label, mask=ok, other=0.0).to(tl.float32) * inv_t
        xl = tl.where(ok & (label < limit), xl, _MASKED)
        tl.store(m_ptr + row, m)
        tl.store(s0_ptr + row, s0)
        tl.store(s1_ptr + row, s1)
        tl.store(xl_ptr + row, xl)

    @triton.jit
    def _grad_kernel(x_ptr, stride, lse_ptr, grad_ptr, label_ptr, n_cols, limit, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n_cols
        ptrs = x_ptr + row.to(tl.int64) * stride + cols
        x = tl.load(ptrs, mask=inside, other=0.0).to(tl.float32) * inv_t
        x = tl.where(cols < limit, x, _MASKED)
        p = tl.exp(x - tl.load(lse_ptr + row))
        onehot = (cols == tl.load(label_ptr + row)).to(tl.float32)
        g = (onehot - p) * (tl.load(grad_ptr + row) * inv_t)
        tl.store(ptrs, g.to(x_ptr.dtype.element_ty), mask=inside)


def row_stats(x: torch.Tensor, label: torch.Tensor, inv_t: float, limit: int) -> tuple[torch.Tensor, ...]:
    """x [c, V_local] (raw logits), label [c] (local column, or -1 if on another TP rank) ->
    m, s0, s1 (this rank's online softmax statistics) and xl (the label's scaled logit,
    MASKED_LOGIT where the label is not here), each [c] float32."""
    c, n = x.shape
    out = torch.empty(4, c, dtype=torch.float32, device=x.device)
    if c:
        _row_stats_kernel[(c,)](x, x.stride(0), label, out[0], out[1], out[2], out[3], n, limit, inv_t,
                                BLOCK=4096, num_warps=16)
    return out[0], out[1], out[2], out[3]


def combine(m: torch.Tensor, s0: torch.Tensor, s1: torch.Tensor, global_m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's (s0, s1) about its own max m, re-expressed about the max over ranks."""
    d = m - global_m
    a = d.exp()
    return a * s0, a * (s1 + d * s0)


def grad_logits_(x: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, label: torch.Tensor, inv_t: float,
                 limit: int) -> torch.Tensor:
    """x [c, V_local] raw logits -> overwritten with d(sum_i grad_i log p_i(label_i)) / d(raw logits)
    = grad_i (1[v = label_i] - p_iv) / temperature; label -1 where it is on another TP rank."""
    c, n = x.shape
    block = 4096
    if c:
        _grad_kernel[(c, triton.cdiv(n, block))](x, x.stride(0), lse, grad, label, n, limit, inv_t,
                                                 BLOCK=block, num_warps=8)
    return x

