"""Fused GPU kernels for the learner's Megatron model and optimizer, without apex or TE.

Owns: `install_wgrad_fusion` (apex's `fused_weight_gradient_mlp_cuda` stand-in: `main_grad += grad_output^T @ input`
as one GEMM writing float32 straight into DDP's gradient buffer, saving a full extra read and write of all gradients
per micro-batch), `install_rope_fusion` (rotary embedding as one compiled kernel each way) and `use_fused_adam`.
The one adapter that reads Megatron's private module state (STYLE 14): `fused_weight_gradient_mlp_cuda`,
`_grad_accum_fusion_available` (tensor_parallel.layers) and `fused_apply_rotary_pos_emb` (rope_utils).
Must never: install anything whose self-check fails (then Megatron's unfused path stays), or install anything on
CPU (the eager RoPE functions run there only in tests).
Details: docs/design/learner.md, "GPU fusions".
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)
_STATE: dict[str, bool] = {}


def _accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32, out=main_grad)


def _accum_half(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    main_grad.addmm_(grad_output.t(), total_input)


def fused_wgrad_accumulation():
    """`f(input, grad_output, main_grad)`: main_grad += grad_output^T @ input in one float32-output
    GEMM, once `install_wgrad_fusion` has passed its self-check; None otherwise."""
    return _accum_fp32 if _STATE.get("ok") else None


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


# ----------------------------------------------------------------------------- rotary embedding
#
# Megatron's unfused RoPE (`_apply_rotary_pos_emb_bshd`) runs cos, sin, two casts, chunk, neg, cat,
# two multiplies, an add and a cat on q and on k in every layer, and as many again backward. Here
# it is one compiled kernel each way, computed in float32 and rounded once; cos and sin of the
# [s, 1, 1, d] float32 freqs (Megatron's RotaryEmbedding, already sliced for this CP rank; one
# tensor for every layer) are computed once per freqs tensor, not per element of q and k.
# freqs = cat(f, f) along the last dim, so y = x cos + R(x) sin with R(x) = (-x2, x1), and
# backward dx = g cos + R^T(g sin) with R^T(y) = (y2, -y1).


def _rope_forward(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    x = t[..., :d].float()
    x1, x2 = x.chunk(2, dim=-1)
    y = (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(t.dtype)
    return y if d == t.shape[-1] else torch.cat((y, t[..., d:]), dim=-1)


def _rope_backward(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = cos.shape[-1]
    x = g[..., :d].float()
    s1, s2 = (x * sin).chunk(2, dim=-1)
    y = (x * cos + torch.cat((s2, -s1), dim=-1)).to(g.dtype)
    return y if d == g.shape[-1] else torch.cat((y, g[..., d:]), dim=-1)


_ROPE: dict[str, Any] = {"fwd": _rope_forward, "bwd": _rope_backward}  # compiled once installed
_COS_SIN: list[Any] = [None, None, None, -1]  # freqs (held, so its id stays unique), cos, sin, version


def _cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _COS_SIN[0] is not freqs or _COS_SIN[3] != freqs._version:
        f = freqs.float()
        _COS_SIN[:] = [freqs, f.cos(), f.sin(), freqs._version]
    return _COS_SIN[1], _COS_SIN[2]


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        cos, sin = _cos_sin(freqs)
        ctx.save_for_backward(cos, sin)
        return _ROPE["fwd"](t, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _ROPE["bwd"](grad, cos, sin), None


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False,
               interleaved: bool = False) -> torch.Tensor:
    """TE's `fused_apply_rotary_pos_emb` signature (sbhd / bshd, non-interleaved)."""
    if interleaved:
        raise ValueError("the learner's fused RoPE is not interleaved (set apply_rope_fusion: false)")
    return _Rope.apply(t, freqs)


def install_rope_fusion() -> bool:
    """Give Megatron a fused RoPE where TE would (CUDA, after a self-check against the unfused
    ops); True when `apply_rope_fusion` may be turned on. TE's own stays when installed."""
    if "rope" in _STATE:
        return _STATE["rope"]
    ok = False
    if torch.cuda.is_available():
        from megatron.core.models.common.embeddings import rope_utils

        if rope_utils.fused_apply_rotary_pos_emb is not None:
            ok = True
        else:
            try:
                _ROPE["fwd"] = torch.compile(_rope_forward, dynamic=True)
                _ROPE["bwd"] = torch.compile(_rope_backward, dynamic=True)
                ok = _rope_self_check(rope_utils)
            except Exception as e:  # noqa: BLE001 - no triton / inductor: Megatron's unfused RoPE stays
                logger.info("fused RoPE unavailable: %s", e)
            if not ok:
                _ROPE.update(fwd=_rope_forward, bwd=_rope_backward)
            if ok:
                rope_utils.fused_apply_rotary_pos_emb = fused_rope
    _STATE["rope"] = ok
    return ok


def _rope_self_check(rope_utils: Any) -> bool:
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(0)
    s, d = 48, 64
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=dev).float() / d))
    f = torch.outer(torch.arange(s, device=dev).float(), inv)
    freqs = torch.cat((f, f), dim=-1)[:, None, None, :]
    x = torch.randn(s, 2, 3, d, device=dev, generator=g, requires_grad=True)
    gy = torch.randn(s, 2, 3, d, device=dev, generator=g)
    want = rope_utils._apply_rotary_pos_emb_bshd(x, freqs)
    (want_grad,) = torch.autograd.grad(want, x, gy)
    got = fused_rope(x, freqs)
    (got_grad,) = torch.autograd.grad(got, x, gy)
    return bool(torch.allclose(got, want, atol=1e-5) and torch.allclose(got_grad, want_grad, atol=1e-5))


# ----------------------------------------------------------------------------- optimizer


def use_fused_adam(optimizer: Any) -> bool:
    """Switch the torch Adam(W) under a Megatron optimizer to its fused CUDA kernel (one pass
    over param, grad and both moments per tensor, instead of foreach's seven) when every master
    parameter is a CUDA float tensor. Megatron builds torch's Adam without `fused` when neither
    TE nor apex is installed. Same update rule; True when switched."""
    inners = [getattr(o, "optimizer", None) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    if not inners or any(not isinstance(o, (torch.optim.Adam, torch.optim.AdamW)) for o in inners):
        return False
    params = [p for o in inners for g in o.param_groups for p in g["params"]]
    if not params or not all(p.is_cuda and p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params):
        return False
    for o in inners:
        for g in o.param_groups:
            if g.get("differentiable") or g.get("capturable"):
                return False
    for o in inners:
        for g in o.param_groups:
            g["foreach"], g["fused"] = False, True
        for p, state in o.state.items():  # the fused kernel reads `step` from device memory
            if "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)
    return True
