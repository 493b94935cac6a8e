"""The learner's fast layer spec: Megatron's own parallel linears, fused attention and norms, no TE.

Owns: which modules fill Megatron's transformer-layer spec when `learner.attention` is `sdpa`
(the default): Megatron's local spec (ColumnParallel / RowParallel linears, its MLP and MoE
layers, its RoPE) with the core attention replaced by `asyncrl.learner.attention.SDPAttention`
and every norm replaced by `RMSNorm` below, whose weight is tagged for Megatron's
sequence-parallel gradient all-reduce, so `sequence_parallel: true` works without TE norms; with
`tp_comm_overlap: true` as well, the linears are `asyncrl.learner.tp_overlap`'s (their all-gathers and
reduce-scatters overlap their GEMMs).

Must never: change parameter names or shapes (weight conversion and checkpoints read the same
state dict as with Megatron's local spec), or change numerics in float32 beyond rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.learner.attention import SDPAttention

ATTENTION_BACKENDS = ("sdpa", "local", "te")


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim (`torch.nn.functional.rms_norm`: one fused kernel on GPU).

    Under sequence parallelism each TP rank normalises its own share of the tokens, so the weight's
    gradient is partial per rank: `sequence_parallel = True` on the weight makes Megatron's
    `finalize_model_grads` sum it over TP (what Transformer Engine's norms do).
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__()
        if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
            raise ValueError(f"normalization={config.normalization!r}: the learner's spec has RMSNorm only")
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise ValueError("layernorm_zero_centered_gamma is not supported by the learner's RMSNorm")
        self.eps, self.shape = eps, (hidden_size,)
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.shape, self.weight, self.eps)


def _is_norm_slot(name: str) -> bool:
    return name.endswith("layernorm") or name == "layer_norm"


def _swap(spec: Any, linears: dict[type, type]) -> Any:
    """A copy of `spec` with core attention, norms and the `linears` classes replaced, recursively."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        if spec.submodules is not None:
            return dataclasses.replace(spec, submodules=_swap(spec.submodules, linears))
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            if f.name == "core_attention":
                changes[f.name] = SDPAttention
            elif _is_norm_slot(f.name) and value is not None and not _is_identity(value):
                changes[f.name] = RMSNorm
            elif isinstance(value, type) and value in linears:
                changes[f.name] = linears[value]
            elif isinstance(value, ModuleSpec) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
                changes[f.name] = _swap(value, linears)
            elif isinstance(value, list):
                changes[f.name] = [_swap(v, linears) for v in value]
        return dataclasses.replace(spec, **changes)
    return spec


def _overlapped_linears(config: Any) -> dict[type, type]:
    """Megatron's parallel linears -> asyncrl's overlapped ones where `tp_comm_overlap` asks for them (Megatron reads
    that option only in its TE layers) and sequence parallelism gives them something to overlap; {} otherwise."""
    if not (config.tp_comm_overlap and config.sequence_parallel and config.tensor_model_parallel_size > 1):
        return {}
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from asyncrl.learner.tp_overlap import OverlappedColumnParallelLinear, OverlappedRowParallelLinear

    return {ColumnParallelLinear: OverlappedColumnParallelLinear, RowParallelLinear: OverlappedRowParallelLinear}


def _is_identity(value: Any) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    target = getattr(value, "module", value)
    return target is IdentityOp


def decoder_block_spec(config: Any, backend: str, vp_stage: int | None = None) -> Any:
    """Megatron's decoder block spec for `backend` (`sdpa` | `local` | `te`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"learner attention={backend!r} must be one of {ATTENTION_BACKENDS}")
    if config.tp_comm_overlap and backend != "sdpa":
        raise ValueError(f"strategy_config.tp_comm_overlap with learner attention={backend!r}: the learner overlaps TP "
                         "communication in its sdpa spec only (TE's overlap needs userbuffers asyncrl does not set up)")
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=backend == "te", normalization="RMSNorm", vp_stage=vp_stage)
    if backend == "te":
        return spec
    if backend == "local":
        spec.layer_norm = WrappedTorchNorm  # the local final norm must be RMSNorm (apex may be picked)
        return spec
    return _swap(spec, _overlapped_linears(config))
