"""Megatron `GPTModel` from a Hugging Face config (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE).

Owns: the mapping HF config -> `TransformerConfig` (attention layout, norms, RoPE, SwiGLU, MoE routing; Megatron
options in `strategy_config` that are `TransformerConfig` fields override it), the layer spec choice
(`learner.attention`: sdpa, local, te, or auto = TE where it imports on GPU, else sdpa), vocab padding, and building
the model chunk(s) of this rank.
Must never: read weights (see `convert.py`), touch torch.distributed beyond what Megatron's constructors do, or
silently accept an architecture feature it does not reproduce (those raise `UnsupportedModelError` naming
`model_type` and the feature).
Details: docs/design/learner.md, "The Megatron model".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")


class UnsupportedModelError(ValueError):
    """The HF architecture (or one of its options) has no Megatron mapping here."""


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """The architecture facts both the model builder and the weight converter need."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_theta: float
    norm_eps: float
    max_position_embeddings: int
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_size: int = 0  # 0 = no shared expert
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    moe_layer_pattern: tuple[int, ...] = ()  # 1 = MoE layer, 0 = dense; empty for dense models

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layer_pattern) and self.moe_layer_pattern[layer] == 1


def _rope(hf: Any) -> float:
    params = getattr(hf, "rope_parameters", None) or {}
    scaling = getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UnsupportedModelError(f"model_type={hf.model_type!r}: rope_type={rope_type!r} is not supported")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    if theta is None:
        raise UnsupportedModelError(f"model_type={hf.model_type!r}: no rope_theta in config")
    return float(theta)


def model_arch(hf: Any) -> ModelArch:
    """Read and check every HF config field we map. Raises UnsupportedModelError on anything else."""
    mt = getattr(hf, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"model_type={mt!r}: hidden_act={hf.hidden_act!r} (only silu/SwiGLU)")
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError(f"model_type={mt!r}: use_sliding_window=True is not supported")
    if getattr(hf, "mlp_bias", False):
        raise UnsupportedModelError(f"model_type={mt!r}: mlp_bias=True is not supported")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    if mt in ("qwen2", "qwen2_moe"):
        qkv_bias = bool(getattr(hf, "qkv_bias", True))  # Qwen2 always has q/k/v biases
    else:
        qkv_bias = bool(getattr(hf, "attention_bias", False))
    arch = dict(
        model_type=mt,
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn_hidden_size=hf.intermediate_size,
        vocab_size=hf.vocab_size,
        tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        rope_theta=_rope(hf),
        norm_eps=float(hf.rms_norm_eps),
        max_position_embeddings=hf.max_position_embeddings,
    )
    if mt in MOE_MODEL_TYPES:
        experts = getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None)
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(hf, "mlp_only_layers", None) or [])
        pattern = tuple(
            0 if (i in dense_only or (i + 1) % step) else 1 for i in range(hf.num_hidden_layers)
        )
        shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
        arch.update(
            num_experts=int(experts),
            moe_topk=int(hf.num_experts_per_tok),
            moe_ffn_hidden_size=int(hf.moe_intermediate_size),
            shared_expert_size=shared,
            shared_expert_gate=shared > 0,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", False)),
            moe_layer_pattern=pattern,
        )
    return ModelArch(**arch)


def padded_vocab_size(vocab_size: int, strategy_config: dict[str, Any]) -> int:
    """Megatron pads the vocab to a multiple of make_vocab_size_divisible_by * TP."""
    divisible_by = int(strategy_config.get("make_vocab_size_divisible_by", 128))
    if divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by={divisible_by} must be >= 1")
    multiple = divisible_by * int(strategy_config.get("tensor_model_parallel_size", 1))
    return -(-vocab_size // multiple) * multiple


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def transformer_config_from_hf(
    hf_config: Any, strategy_config: dict[str, Any], dtype: torch.dtype | str = torch.float32,
    attention: str = "local", trainable: bool = False,
):
    """The `TransformerConfig` reproducing `hf_config`; Megatron keys in `strategy_config` override."""
    from megatron.core.transformer import TransformerConfig

    arch = model_arch(hf_config)
    dtype = _as_dtype(dtype)
    on_cpu = not torch.cuda.is_available()
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        # Fused kernels are CUDA-only; on GPU the caller may turn them on via strategy_config.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
    )
    if attention == "sdpa" and not on_cpu:
        # Megatron's SwiGLU autograd function (no bias): one compiled kernel, and it keeps only its
        # input for backward, not the gate's activation. Megatron compiles it with torch.compile,
        # whose CPU backend the CPU compat layer cannot host, so CPU keeps the plain ops.
        kwargs["bias_activation_fusion"] = True
        from asyncrl.learner.gpu_fusions import install_rope_fusion

        # RoPE on q and k as one compiled kernel each way (Megatron's TE slot; see gpu_fusions.py).
        kwargs["apply_rope_fusion"] = install_rope_fusion()
        if trainable and dtype != torch.float32:
            from asyncrl.learner.gpu_fusions import install_wgrad_fusion

            # Weight grads accumulate straight into DDP's float32 main_grad (see gpu_fusions.py).
            kwargs["gradient_accumulation_fusion"] = install_wgrad_fusion()
    if arch.num_experts:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_layer_freq=list(arch.moe_layer_pattern),
            # HF: softmax over all experts, then top-k; renormalised only when norm_topk_prob.
            # Megatron without pre-softmax = softmax over the top-k logits = renormalised.
            moe_router_pre_softmax=not arch.norm_topk_prob,
            moe_token_dispatcher_type="alltoall",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
        )
        if arch.shared_expert_size:
            kwargs.update(
                moe_shared_expert_intermediate_size=arch.shared_expert_size,
                moe_shared_expert_gate=arch.shared_expert_gate,
            )
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs.update({k: v for k, v in strategy_config.items() if k in fields})
    if kwargs.get("tensor_model_parallel_size", 1) > 1 and arch.num_experts and "expert_tensor_parallel_size" not in kwargs:
        kwargs["expert_tensor_parallel_size"] = kwargs["tensor_model_parallel_size"]
    if (kwargs.get("virtual_pipeline_model_parallel_size") or 1) <= 1:
        kwargs["virtual_pipeline_model_parallel_size"] = None
    else:
        # Megatron-LM's own setting for the interleaved schedule. With PP=2 the previous and next
        # stage are one rank, and batched p2p matches that rank's activation and gradient messages
        # in issue order, i.e. crosswise (gloo: wrong grads or a shape error in backward).
        kwargs.setdefault("overlap_p2p_comm", True)
        kwargs.setdefault("batch_p2p_comm", False)
    return TransformerConfig(**kwargs)


def use_transformer_engine(strategy_config: dict[str, Any]) -> bool:
    """TE spec only on GPU with transformer_engine importable (opt out: `use_te: false`)."""
    if not torch.cuda.is_available() or not strategy_config.get("use_te", True):
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_attention(attention: str, strategy_config: dict[str, Any]) -> str:
    """`auto` -> `te` where Transformer Engine imports on GPU, else `sdpa`; others as given."""
    if attention == "auto":
        return "te" if use_transformer_engine(strategy_config) else "sdpa"
    if attention == "te" and not use_transformer_engine({}):
        raise UnsupportedModelError("learner.attention='te' needs a GPU with transformer_engine importable")
    return attention


def build_gpt_model(
    hf_config: Any,
    strategy_config: dict[str, Any],
    *,
    pre_process: bool,
    post_process: bool,
    vp_stage: int | None = None,
    dtype: torch.dtype | str = torch.float32,
    attention: str = "auto",
    trainable: bool = False,
):
    """Build this rank's `GPTModel` chunk (parallel_state must be initialised). `trainable`: it will
    be wrapped in Megatron DDP (whose float32 main_grad buffers the fused wgrad writes into)."""
    from megatron.core.models.gpt import GPTModel

    from asyncrl.learner.layer_spec import decoder_block_spec

    arch = model_arch(hf_config)
    attention = resolve_attention(attention, strategy_config)
    config = transformer_config_from_hf(hf_config, strategy_config, dtype, attention, trainable)
    spec = decoder_block_spec(config, attention, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, strategy_config),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        # Megatron builds some modules on the host whatever `use_cpu_initialization` says (the local
        # spec's torch RMSNorm); its own training loop moves the model with `.cuda()`, as we do.
        return model.to(device=torch.cuda.current_device(), dtype=_as_dtype(dtype))
    return model.to(_as_dtype(dtype))


def build_model_chunks(
    hf_config: Any, strategy_config: dict[str, Any], dtype: torch.dtype | str = torch.float32,
    attention: str = "auto", trainable: bool = False,
) -> list:
    """All model chunks of this rank: one per virtual pipeline stage (one without VPP)."""
    from megatron.core import parallel_state as ps

    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    chunks = []
    for stage in range(vpp):
        vp_stage = stage if vpp > 1 else None
        chunks.append(
            build_gpt_model(
                hf_config,
                strategy_config,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                vp_stage=vp_stage,
                dtype=dtype,
                attention=attention,
                trainable=trainable,
            )
        )
    return chunks
