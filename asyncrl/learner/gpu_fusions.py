"""Fused weight-gradient accumulation for Megatron's parallel linears, without apex or TE.

Owns: the stand-in for apex's `fused_weight_gradient_mlp_cuda` that Megatron's
`LinearWithGradAccumulationAndAsyncCommunication` calls when `gradient_accumulation_fusion` is
on: `main_grad += grad_output^T @ input`, one cuBLAS GEMM writing float32 straight into the
DDP's float32 gradient buffer from bf16 operands (`torch.addmm(..., out_dtype=float32, out=)`).
Without it every micro-batch writes a bf16 `.grad` per weight that DDP's hook then adds into
`main_grad`: a full extra read and write of all gradients per micro-batch.

This is the one adapter that reads Megatron's private module state (STYLE 14): the module-level
`fused_weight_gradient_mlp_cuda` and `_grad_accum_fusion_available` of
`megatron.core.tensor_parallel.layers` (0.16.1 and 0.19.2 have both).

Must never: install itself where the GEMM it relies on fails its self-check (then Megatron's
unfused path stays), or run on CPU.
"""

from __future__ import annotations

import logging
import types

import torch

logger = logging.getLogger(__name__)
_STATE: dict[str, bool] = {}


def _accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def _accum_half(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t(), total_input)


def _self_check() -> bool:
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(64, 48, device=dev, generator=g).bfloat16()
    b = torch.randn(64, 32, device=dev, generator=g).bfloat16()
    acc = torch.randn(32, 48, device=dev, generator=g)
    want = acc + b.float().t() @ a.float()
    _accum_fp32(a, b, acc)
    return bool(torch.allclose(acc, want, rtol=1e-2, atol=1e-2))


def install_wgrad_fusion() -> bool:
    """Make Megatron's gradient-accumulation fusion available; True when it is (CUDA only)."""
    if "ok" in _STATE:
        return _STATE["ok"]
    ok = False
    if torch.cuda.is_available():
        try:
            ok = _self_check()
        except Exception as e:  # noqa: BLE001 - an older torch without the out_dtype GEMM
            logger.info("fused wgrad accumulation unavailable: %s", e)
        if ok:
            from megatron.core.tensor_parallel import layers

            if not layers._grad_accum_fusion_available:
                layers.fused_weight_gradient_mlp_cuda = types.SimpleNamespace(
                    wgrad_gemm_accum_fp32=_accum_fp32, wgrad_gemm_accum_fp16=_accum_half
                )
                layers._grad_accum_fusion_available = True
    _STATE["ok"] = ok
    return ok
