"""`hybrid.enabled: auto`: the app picks separated or hybrid placement at start, and says which and why.

Owns: the learner's device-memory estimate for a model, the choice (pure: `choose_placement`), the config
that carries it out (`apply_choice`: hybrid turns on the engine's sleep mode and the actor's offload flags
a user left unset), and the probe of a device's memory (a Ray task on a GPU, or this process's CUDA view).
The rule: when the engine and the learner share one device, separated placement (both awake at once, so
generation overlaps training for eta > 0) if the learner's state and activations plus the engine's
`gpu_memory_utilization` share fit on it, else hybrid (they take turns); devices of their own, or none: separated.
Must never: start an engine or a learner, or touch a config whose `hybrid.enabled` is not `auto`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

GIB = float(2**30)
# Per parameter on the learner's device: bf16 weights 2 + fp32 main params 4 + Adam's two moments 8 + fp32
# grads 4 (Megatron's DDP reduces grads in fp32, asyncrl/learner/roles/base.py).
BYTES_PER_PARAM = 18
# Bytes per element of what a layer keeps for its backward (bf16).
ACTIVATION_ELEMENT_BYTES = 2
# Of the device, what the two may take together: the CUDA context, allocator fragmentation and the push's
# staging need the rest.
FIT_SHARE = 0.9
VLLM_DEFAULT_UTILIZATION = 0.9


@dataclass(frozen=True)
class PlacementChoice:
    """The placement an `auto` run takes, and the sentence that says why (logged at start)."""

    hybrid: bool
    reason: str

    @property
    def name(self) -> str:
        return "hybrid" if self.hybrid else "separated"


def model_params(hf_config: Any) -> int:
    """Parameters of a decoder-only HF config (dense or MoE: every expert counted; tied embedding once)."""
    c = hf_config
    h, layers, vocab = c.hidden_size, c.num_hidden_layers, c.vocab_size
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    qkv_bias = getattr(c, "attention_bias", getattr(c, "model_type", "") in ("qwen2", "qwen2_moe"))  # Qwen2's q/k/v
    attn = (h + bool(qkv_bias)) * head_dim * (heads + 2 * kv) + head_dim * heads * h
    experts = getattr(c, "num_experts", 0) or 0
    if experts:
        mlp = 3 * h * c.moe_intermediate_size * experts + 3 * h * (getattr(c, "shared_expert_intermediate_size", 0) or 0)
    else:
        mlp = 3 * h * c.intermediate_size
    emb = vocab * h * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return layers * (attn + mlp + 2 * h) + h + emb


# Of BYTES_PER_PARAM, what Megatron's host optimizer (learner.memory.optimizer: host) takes off the device per
# offloaded parameter: Adam's two fp32 moments (its fp32 main params stay on the device); and what a LoRA actor
# keeps per base parameter: its frozen bf16 weight alone (no grad, no optimizer state; the adapters are small).
HOST_OPTIMIZER_SAVES = 8
LORA_BYTES_PER_PARAM = 2


def bytes_per_param(learner: Any = None) -> float:
    """The actor's device bytes per model parameter under `learner` (a LearnerConfig; None: the defaults)."""
    if learner is not None and learner.lora is not None:
        return LORA_BYTES_PER_PARAM
    if learner is not None and learner.memory.optimizer == "host":
        return BYTES_PER_PARAM - HOST_OPTIMIZER_SAVES * learner.memory.optimizer_host_fraction
    return BYTES_PER_PARAM


def layer_activation_bytes(hf_config: Any) -> float:
    """Bytes one token keeps for the backward in one decoder layer without recompute (bf16): both norms' inputs and
    outputs (the linears' inputs), q, k and v before and after RoPE, the attention output, and the MLP's SwiGLU input
    (2 x FFN) and output (FFN); MoE: the routed experts' FFN per token and the permuted copies of its input. Megatron's
    34 h bytes assumes a GeLU MLP of FFN = 4 h, and under-counts a SwiGLU of FFN > 4 h by a third: an estimate that
    is short picks a placement that runs out of memory, so this one errs high."""
    c = hf_config
    h, heads = c.hidden_size, c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(c, "num_key_value_heads", None) or heads) * head_dim
    experts_per_token = getattr(c, "num_experts_per_tok", 0) if getattr(c, "num_experts", 0) else 0
    if experts_per_token:
        ffn = c.moe_intermediate_size * experts_per_token + (getattr(c, "shared_expert_intermediate_size", 0) or 0)
        routed = 2 * h * experts_per_token
    else:
        ffn, routed = c.intermediate_size, 0
    elements = 4 * h + 2 * (q + 2 * kv) + q + q + 3 * ffn + routed
    return float(ACTIVATION_ELEMENT_BYTES * elements)


def learner_bytes(hf_config: Any, tokens_per_micro_batch: int, logprob_chunk: int, learner: Any = None) -> float:
    """What the actor needs on its device while it trains: its state (`bytes_per_param`: LoRA and a host optimizer
    keep less), one micro-batch's activations (with full recompute, each layer's input and one layer's whole) and
    the LM head's chunk of logits (float32, forward and backward)."""
    c = hf_config
    state = bytes_per_param(learner) * model_params(c)
    layer = layer_activation_bytes(c) * tokens_per_micro_batch
    if learner is not None and learner.memory.recompute == "full":
        activations = 2 * tokens_per_micro_batch * c.hidden_size * c.num_hidden_layers + layer
    else:
        activations = layer * c.num_hidden_layers
    logits = 2 * 4 * min(logprob_chunk, tokens_per_micro_batch) * c.vocab_size
    return float(state + activations + logits)


def micro_batch_tokens(cfg: Any) -> int:
    """The most tokens one of the learner's micro-batches holds (its token budget, or micro_batch_size sequences of
    model.max_model_len)."""
    learner = cfg.learner
    return learner.max_tokens_per_micro_batch or learner.micro_batch_size * (
        cfg.model.max_model_len or cfg.algorithm.max_new_tokens + 512)


def choose_placement(cfg: Any, hf_config: Any, device_bytes: float | None) -> PlacementChoice:
    """The placement for `cfg` (a RootConfig) on devices of `device_bytes` each (None: no GPU)."""
    gen, learner = cfg.generator, cfg.learner
    if device_bytes is None or gen.num_gpus <= 0 or learner.num_gpus_per_rank <= 0:
        return PlacementChoice(False, "separated: no GPU for the engine and the learner to time-share (hybrid "
                                      "placement needs CUDA devices)")
    if gen.num_gpus >= 1 and learner.num_gpus_per_rank >= 1:
        return PlacementChoice(False, f"separated: the engines (generator.num_gpus={gen.num_gpus:g}) and the learner "
                                      f"ranks (learner.num_gpus_per_rank={learner.num_gpus_per_rank:g}) have devices "
                                      "of their own")
    tokens = micro_batch_tokens(cfg)
    need = learner_bytes(hf_config, tokens, learner.logprob_chunk_size, learner)
    share = float(gen.engine_kwargs.get("gpu_memory_utilization", VLLM_DEFAULT_UTILIZATION))
    engine = share * device_bytes
    room = FIT_SHARE * device_bytes
    fits = need + engine <= room
    n = model_params(hf_config)
    count = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    sizes = (f"the learner needs ~{need / GIB:.{0 if need >= 10 * GIB else 1}f} GiB ({count} parameters x "
             f"{bytes_per_param(learner):g} B, and a micro-batch of {tokens} tokens), the engine "
             f"{engine / GIB:.0f} GiB (gpu_memory_utilization {share:g} of {device_bytes / GIB:.0f} GiB)")
    if fits:
        return PlacementChoice(False, f"separated: {sizes}: both fit at once in {room / GIB:.0f} GiB, so generation "
                                      "overlaps training")
    return PlacementChoice(True, f"hybrid: {sizes}: together more than {room / GIB:.0f} GiB, so they take turns on "
                                 "the device (the engine sleeps while the learner trains)")


def apply_choice(cfg: Any, choice: PlacementChoice) -> Any:
    """`cfg` with `hybrid.enabled` set to the choice; hybrid also turns on the engine's sleep mode and the
    actor's param / grad / optimizer offload flags that were left unset (`hybrid.learner_offload` still
    keeps the state on the device where the engine's wake fits beside it)."""
    update: dict[str, Any] = {"hybrid": cfg.hybrid.model_copy(update={"enabled": choice.hybrid})}
    if choice.hybrid:
        sleep_key = "enable_memory_saver" if cfg.generator.engine == "sglang" else "enable_sleep_mode"
        kwargs = {sleep_key: True, **cfg.generator.engine_kwargs}
        update["generator"] = cfg.generator.model_copy(update={"engine_kwargs": kwargs})
        actor = cfg.learner.actor
        flags = {k: True for k in ("param_offload", "grad_offload", "optimizer_offload") if k not in actor.model_fields_set}
        update["learner"] = cfg.learner.model_copy(update={"actor": actor.model_copy(update=flags)})
    return type(cfg).model_validate(cfg.model_copy(update=update).model_dump())


def device_memory_bytes(timeout_s: float = 60.0) -> float | None:
    """One GPU's memory: from a Ray task on a GPU when Ray runs (the driver may have none), else from this
    process; None without a GPU. A task no GPU takes within `timeout_s` (every one busy) is cancelled and
    raises `GetTimeoutError`."""
    import ray

    if ray.is_initialized():
        if ray.cluster_resources().get("GPU", 0) <= 0:
            return None
        ref = ray.remote(num_gpus=0.01, num_cpus=0)(_total_memory).remote()
        try:
            total = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=True)
            raise
        return None if total is None else float(total)  # (a node that declares GPUs CUDA does not see)
    return _total_memory()


def _total_memory() -> float | None:
    import torch

    return float(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def resolve_placement(cfg: Any, probe: Any = device_memory_bytes) -> Any:
    """`cfg` unchanged unless `hybrid.enabled` is `auto`; then with the placement chosen and logged."""
    if cfg.hybrid.enabled != "auto":
        return cfg
    from transformers import AutoConfig

    from asyncrl.config import ConfigError

    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"hybrid.enabled='auto' sizes the learner from model.path={cfg.model.path!r}, which holds no "
                          f"readable Hugging Face config ({type(err).__name__}: {err})") from None
    choice = choose_placement(cfg, hf_config, probe())
    log.warning("placement (hybrid.enabled: auto): %s", choice.reason)
    return apply_choice(cfg, choice)
