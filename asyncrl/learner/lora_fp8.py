"""A LoRA linear's frozen base in FP8 (`learner.lora.base_fp8`): its GEMMs, forward and input gradient, in e4m3.

Owns: the base weight quantized once (it never changes) in the two layouts its GEMMs read, per output channel for
the forward and per input channel for the input gradient; each input and output gradient quantized per row as it
comes; `Fp8LoraLinear`, the linear y = x W^T + s (x_a A^T) B^T whose base GEMMs run through `torch._scaled_mm` and
whose adapters (and their gradients) stay in the model's dtype.
Must never: hold a quantized copy of a weight that changed since (the copy is keyed on the weight's storage and
version), or quantize anything the optimizer steps.
"""

from __future__ import annotations

from typing import Any

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
ALIGN = 16  # _scaled_mm's CUDA kernels want every dimension a multiple of 16: the rows are padded to it


def fp8_unsupported(weight: torch.Tensor) -> str | None:
    """Why `weight`'s linear cannot run its GEMMs in FP8 here, or None: CUDA wants a GPU of compute capability 8.9
    or newer and both of the weight's dimensions multiples of 16 (CPU runs any)."""
    if weight.device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(weight.device)
    if cap < (8, 9):
        return f"FP8 GEMMs need a GPU of compute capability 8.9 or newer; this one is {cap[0]}.{cap[1]}"
    if weight.shape[0] % ALIGN or weight.shape[1] % ALIGN:
        return f"its local weight is {tuple(weight.shape)}; FP8 GEMMs need both dimensions multiples of {ALIGN}"
    return None


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale  # (the cast to e4m3fn does not saturate)


_fused: Any = None  # _quantize compiled for the GPU: one kernel reads x twice where eager makes six passes


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [n, k] as e4m3 with a float32 scale per row ([n', 1], x ~ q * scale), n' = n rounded up to 16, the
    padding rows zero. On a GPU through one compiled kernel (eager where torch.compile cannot run)."""
    global _fused
    if x.device.type == "cuda":
        if _fused is None:
            _fused = torch.compile(_quantize, dynamic=True)
        try:
            q, scale = _fused(x)
        except Exception as e:  # (no Triton, an inductor error: numerics are the same eagerly)
            import logging

            logging.getLogger(__name__).warning("learner.lora.base_fp8: quantizing eagerly (%s: %s)",
                                                type(e).__name__, str(e)[:200])
            _fused = _quantize
            q, scale = _quantize(x)
    else:
        q, scale = _quantize(x)
    pad = (-x.shape[0]) % ALIGN
    if pad:
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        scale = torch.cat([scale, scale.new_ones(pad, 1)])
    return q, scale


class Fp8Weight:
    """A frozen weight [out, in] in e4m3: `fwd` ([out, in], scale per output row) for x W^T and `bwd` ([in, out],
    scale per input column) for dy W, each laid out so that its transpose is the column-major operand _scaled_mm
    takes. Rebuilt when the weight's storage or version moves (a checkpoint load, an offload round trip)."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.fwd = self.fwd_scale = self.bwd = self.bwd_scale = None

    def of(self, weight: torch.Tensor) -> "Fp8Weight":
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.device)
        if key != self.key:
            self.drop()
            with torch.no_grad():
                w = weight.detach().float()
                s = w.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(E4M3_MAX)  # [out, 1]
                self.fwd, self.fwd_scale = (w / s).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3), s.reshape(1, -1).contiguous()
                s = w.abs().amax(dim=0, keepdim=True).clamp_(min=1e-12).div_(E4M3_MAX)  # [1, in]
                self.bwd, self.bwd_scale = (w / s).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3).t().contiguous(), s
                del w
            self.key = key
        return self

    def drop(self) -> None:
        """Free the quantized copies (the weight is leaving the device); the next use rebuilds them."""
        self.key, self.fwd, self.fwd_scale, self.bwd, self.bwd_scale = None, None, None, None, None


def _mm(q: torch.Tensor, q_scale: torch.Tensor, n: int, w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype,
        fast: bool) -> torch.Tensor:
    """The first `n` rows of (q * q_scale) @ (w * w_scale)^T, in `dtype` (w: [cols, k] row-major)."""
    return torch._scaled_mm(q, w.t(), q_scale, w_scale, out_dtype=dtype, use_fast_accum=fast)[:n]


class Fp8LoraLinear(torch.autograd.Function):
    """y = x W^T (+ bias) + s (x_a A^T) B^T with W in FP8 (`Fp8Weight`): the base's forward and input-gradient GEMMs in
    e4m3 (the forward's with fast accumulation, the gradient's without), the adapters' in the input's dtype. x_a is
    the adapters' input (x, or x after dropout: its gradient goes back through the dropout). Tensor parallelism as
    `_MergedLinear`'s: a row linear's u is summed over TP for dB (its output adds up over TP as Megatron's does), a
    column linear's s dy B for dA; `dgrad_group` all-reduces the input gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_a: torch.Tensor, w8: Fp8Weight, bias: torch.Tensor | None,
                a: torch.Tensor, b: torch.Tensor, scale: float, u_group: Any, du_group: Any, dgrad_group: Any) -> Any:
        x2 = x.reshape(-1, x.shape[-1])
        q, qs = quantize_rows(x2)
        y = _mm(q, qs, x2.shape[0], w8.fwd, w8.fwd_scale, x.dtype, True)
        u = torch.matmul(x_a.reshape(-1, x_a.shape[-1]), a.t())
        y = torch.addmm(y, u, b.t(), alpha=scale)  # (a row linear's u is partial here: its y adds up over TP)
        if bias is not None:
            y = y + bias
        if u_group is not None:
            torch.distributed.all_reduce(u, group=u_group)
        ctx.save_for_backward(x_a, a, b, u)
        ctx.w8, ctx.scale, ctx.du_group, ctx.dgrad_group = w8, scale, du_group, dgrad_group
        ctx.same = x_a is x
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x_a, a, b, u = ctx.saved_tensors
        w8 = ctx.w8
        dy2 = dy.reshape(-1, dy.shape[-1])
        q, qs = quantize_rows(dy2)
        dx = _mm(q, qs, dy2.shape[0], w8.bwd, w8.bwd_scale, dy.dtype, False)
        du = torch.matmul(dy2, b).mul_(ctx.scale)
        dx_a = torch.addmm(dx, du, a) if ctx.same else torch.matmul(du, a)
        pending = None
        if ctx.dgrad_group is not None:
            pending = torch.distributed.all_reduce(dx_a if ctx.same else dx, group=ctx.dgrad_group, async_op=True)
            if not ctx.same:
                torch.distributed.all_reduce(dx_a, group=ctx.dgrad_group)
        if ctx.du_group is not None:
            torch.distributed.all_reduce(du, group=ctx.du_group)
        da = torch.matmul(du.t(), x_a.reshape(-1, x_a.shape[-1]))
        db = torch.matmul(dy2.t(), u).mul_(ctx.scale)
        if pending is not None:
            pending.wait()
        lead = dy.shape[:-1]
        if ctx.same:
            return dx_a.view(*lead, -1), None, None, None, da, db, None, None, None, None
        return dx.view(*lead, -1), dx_a.view(*lead, -1), None, None, da, db, None, None, None, None


def fp8_lora_linear(x: torch.Tensor, x_a: torch.Tensor, w8: Fp8Weight, bias: torch.Tensor | None, a: torch.Tensor,
                    b: torch.Tensor, scale: float, u_group: Any, du_group: Any, dgrad_group: Any) -> torch.Tensor:
    """`Fp8LoraLinear` where gradients flow; without them (log-prob passes) the same forward, nothing kept."""
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad or x.requires_grad):
        return Fp8LoraLinear.apply(x, x_a, w8, bias, a, b, scale, u_group, du_group, dgrad_group)
    x2 = x.reshape(-1, x.shape[-1])
    q, qs = quantize_rows(x2)
    y = _mm(q, qs, x2.shape[0], w8.fwd, w8.fwd_scale, x.dtype, True)
    y = torch.addmm(y, torch.matmul(x_a.reshape(-1, x_a.shape[-1]), a.t()), b.t(), alpha=scale)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])
