"""Sequence-parallel linears whose TP communication overlaps their GEMMs, without Transformer Engine.

Owns: `OverlappedColumnParallelLinear` and `OverlappedRowParallelLinear`, Megatron's ColumnParallelLinear and
RowParallelLinear (same parameters, state dict and results), taken by the learner's layer spec when
`strategy_config.tp_comm_overlap` is set with `sequence_parallel` (Megatron reads that option only in its TE layers).
Why: Megatron's local linears all-gather the sequence before the column GEMM and reduce-scatter it after the row GEMM,
wholly on the critical path. Here the sequence goes round the TP ring in blocks (`_Ring`): while one block's GEMM
runs, the next block is on the wire. The column backward keeps Megatron's own overlap (the input's all-gather beside
the input-grad GEMM, the reduce-scatter beside the weight-grad GEMM).
Must never: hold the gathered input for backward (gathered again there, as Megatron does), or change results beyond
bf16 summation order (a reduce-scatter's partial sums are added in ring order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class _Ring:
    """A TP group as a ring: this rank sends to the next and receives from the previous."""

    def __init__(self, group: Any) -> None:
        ranks = dist.get_process_group_ranks(group)
        self.group, self.size, self.rank = group, len(ranks), dist.get_rank(group)
        self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def shift(self, send: torch.Tensor, recv: torch.Tensor) -> list[Any]:
        """Send `send` on, receive the previous rank's into `recv`; one batched call, since with two ranks the
        peer is both (two separate NCCL calls would each wait for the other's)."""
        return dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ])

    def all_gather(self, out: torch.Tensor, x: torch.Tensor) -> Any:
        return dist.all_gather_into_tensor(out, x, group=self.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, x: torch.Tensor) -> Any:
        return dist.reduce_scatter_tensor(out, x, group=self.group, async_op=True)


def _rows(t: torch.Tensor, block: int, size: int) -> torch.Tensor:
    return t[block * size:(block + 1) * size]


def _wait(works: list[Any]) -> None:
    for w in works:
        w.wait()


def _all_gather_matmul(x: torch.Tensor, weight: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """allgather(x along dim 0) @ weight^T: each block's GEMM runs while the next block arrives."""
    rows = x.shape[0]
    out = x.new_empty((rows * ring.size, *x.shape[1:-1], weight.shape[0]))
    cur = x
    for k in range(ring.size):
        works, nxt = [], None
        if k < ring.size - 1:
            nxt = torch.empty_like(x)
            works = ring.shift(cur, nxt)
        torch.matmul(cur, weight.t(), out=_rows(out, (ring.rank - k) % ring.size, rows))
        _wait(works)
        cur = nxt
    return out


def _matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """reduce_scatter(x @ weight^T along dim 0): block d's partial sum goes round the ring from rank d + 1 and ends,
    complete, on rank d; each rank computes the next block's partial while the last one is on the wire."""
    rows = x.shape[0] // ring.size
    works, recv = [], None
    for k in range(ring.size):
        part = torch.matmul(_rows(x, (ring.rank - 1 - k) % ring.size, rows), weight.t())
        _wait(works)
        if recv is not None:
            part += recv
        if k < ring.size - 1:
            recv = torch.empty_like(part)
            works = ring.shift(part, recv)
    return part  # the last block is this rank's own, complete


def _wgrad(weight: torch.Tensor, grad_out: torch.Tensor, total_in: torch.Tensor, fusion: bool) -> torch.Tensor | None:
    """The weight's grad from 2-D grad_output and input. With gradient-accumulation fusion it is added into DDP's
    float32 `weight.main_grad` in the GEMM (what Megatron's own linear does) and autograd gets a placeholder."""
    from asyncrl.learner.gpu_fusions import fused_wgrad_accumulation

    main_grad = getattr(weight, "main_grad", None) if fusion else None
    accum = fused_wgrad_accumulation() if main_grad is not None and main_grad.dtype == torch.float32 else None
    if accum is None:
        return grad_out.t().matmul(total_in)
    accum(total_in, grad_out, main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # DDP's hook runs on the grad autograd hands the weight: a placeholder, already counted in main_grad
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=grad_out.dtype, device=grad_out.device)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _ColumnOverlap(torch.autograd.Function):
    """Megatron's sequence-parallel column linear: y = allgather(x) @ W^T (+ b)."""

    @staticmethod
    def forward(ctx, x, weight, bias, fusion: bool, ring: _Ring):
        ctx.save_for_backward(x, weight)
        ctx.fusion, ctx.ring, ctx.use_bias = fusion, ring, bias is not None
        out = _all_gather_matmul(x, weight, ring)
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ring = ctx.ring
        want_w = ctx.needs_input_grad[1]
        gathered, gather = None, None
        if want_w:  # gathered again for the weight's grad while the input's grad GEMM runs
            gathered = x.new_empty((x.shape[0] * ring.size, *x.shape[1:]))
            gather = ring.all_gather(gathered, x.contiguous())
        grad_full = grad_out.matmul(weight)
        grad_x = torch.empty_like(x)
        scatter = ring.reduce_scatter(grad_x, grad_full)
        grad_w = grad_b = None
        if want_w:
            gather.wait()
            grad_w = _wgrad(weight, _flat(grad_out), _flat(gathered), ctx.fusion)
        if ctx.use_bias:
            grad_b = _flat(grad_out).sum(dim=0)
        scatter.wait()
        return grad_x, grad_w, grad_b, None, None


class _RowOverlap(torch.autograd.Function):
    """Megatron's sequence-parallel row linear (no bias: the module adds it): y = reduce_scatter(x @ W^T)."""

    @staticmethod
    def forward(ctx, x, weight, fusion: bool, ring: _Ring):
        ctx.save_for_backward(x, weight)
        ctx.fusion, ctx.ring = fusion, ring
        return _matmul_reduce_scatter(x, weight, ring)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ring = ctx.ring
        rows = grad_out.shape[0]
        # The output grad's blocks go round the ring into one gathered buffer; each block's input-grad GEMM runs
        # while the next block arrives. The weight's grad then takes the whole buffer in one GEMM.
        grad_full = grad_out.new_empty((rows * ring.size, *grad_out.shape[1:]))
        _rows(grad_full, ring.rank, rows).copy_(grad_out)
        grad_x = x.new_empty(x.shape)
        for k in range(ring.size):
            src = (ring.rank - k) % ring.size
            works = []
            if k < ring.size - 1:
                works = ring.shift(_rows(grad_full, src, rows), _rows(grad_full, (src - 1) % ring.size, rows))
            torch.matmul(_rows(grad_full, src, rows), weight, out=_rows(grad_x, src, rows))
            _wait(works)
        grad_w = _wgrad(weight, _flat(grad_full), _flat(x), ctx.fusion) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None, None


def _ring_of(layer: Any) -> _Ring:
    """The layer's TP group as a ring, made at its first forward."""
    if not hasattr(layer, "_ring"):
        layer._ring = _Ring(layer.tp_group)
    return layer._ring


class OverlappedColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear whose sequence-parallel all-gather overlaps its GEMM (see the module docstring)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        seq = kwargs.get("sequence_parallel", False)
        if not seq or kwargs.get("grad_output_buffer") is not None or self.tp_group.size() == 1:
            return super()._forward_impl(input, weight, *args, **kwargs)
        fusion = bool(kwargs.get("gradient_accumulation_fusion")) and weight.requires_grad
        return _ColumnOverlap.apply(input, weight, kwargs.get("bias"), fusion, _ring_of(self))


class OverlappedRowParallelLinear(RowParallelLinear):
    """RowParallelLinear whose sequence-parallel reduce-scatter overlaps its GEMM (see the module docstring)."""

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.sequence_parallel or self.explicit_expert_comm or self.tp_group.size() == 1:
            return super().forward(input_)
        fusion = bool(self.gradient_accumulation_fusion) and self.weight.requires_grad
        out = _RowOverlap.apply(input_, self.weight, fusion, _ring_of(self))
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None
