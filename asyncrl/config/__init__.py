"""The root configuration and one section per component.

Owns: the schema of every knob, its validation, and loading it from a standalone YAML file or
from the `args` of a Ray Serve config. Each component is handed only its own section
(`cfg.generator`, `cfg.buffer`, ...), never the root. The sections live in `base.py` (shared
pieces), `components.py` (the running components') and `training.py` (data, rewards, rollouts,
the loop's); this module holds the root, its cross-section checks and the loaders.

Must never: import a component, start a process, or read the environment beyond the documented
`ASYNCRL_ADMIN_TOKEN` fallback. Engine and Megatron options are passed through untouched
(`generator.engine_kwargs`, `learner.strategy_config`); only the keys we interpret are checked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from asyncrl.config.base import ConfigError, ResourcePool, _Section
from asyncrl.config.components import (
    AlgorithmConfig,
    AutoscalingConfig,
    BufferConfig,
    CheckpointConfig,
    GeneratorConfig,
    HybridConfig,
    LearnerConfig,
    LoggingConfig,
    ModelConfig,
    ProfilerConfig,
    RoleOffload,
    WandbConfig,
    WeightsyncConfig,
)
from asyncrl.config.training import DataColumns, DataConfig, JudgeConfig, RewardConfig, RewardModelConfig, RolloutConfig, TrainerConfig


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
        if self.hybrid.enabled is True:  # ("auto" is decided, and then checked, when the app starts)
            sleep_key = "enable_memory_saver" if self.generator.engine == "sglang" else "enable_sleep_mode"
            missing = [need for need, ok in (
                ("learner.num_gpus_per_rank > 0", self.learner.num_gpus_per_rank > 0),
                ("generator.num_gpus > 0", self.generator.num_gpus > 0),
                (f"generator.engine_kwargs.{sleep_key}: true", self.generator.engine_kwargs.get(sleep_key) is True),
            ) if not ok]
            if missing:
                raise ValueError(
                    f"hybrid.enabled=true (learner and engines time-share GPUs; engines sleep while the learner "
                    f"trains, which vLLM and SGLang support on GPUs only) needs {', '.join(missing)}; on a CPU-only host use "
                    "separated placement (deploy/rlhf.yaml)")
        engine_dtype = self.generator.engine_kwargs.get("dtype", self.model.dtype)
        if self.generator.engine == "sglang" and engine_dtype in ("float32", "float"):
            # SGLang 0.5.15's CUDA RMSNorm has no float32 kernel: its engine dies capturing its first CUDA graph
            # ("rmsnorm ... failed to dispatch data type Float")
            raise ValueError(
                f"generator.engine='sglang' runs in half precision only (its RMSNorm kernel has no float32 path), and "
                f"its dtype here is {engine_dtype!r}: set model.dtype to bfloat16 or float16, or "
                "generator.engine_kwargs.dtype (e.g. float16) to keep the learner in model.dtype")
        if self.learner.routing_replay:  # the engine must return what the learner replays
            if self.generator.engine != "vllm":
                raise ValueError(f"learner.routing_replay needs the engine's routed experts, which asyncrl reads from vLLM "
                                 f"(enable_return_routed_experts); generator.engine={self.generator.engine!r} does not give them")
            if self.generator.engine_kwargs.get("enable_return_routed_experts", True) is not True:
                raise ValueError("learner.routing_replay needs generator.engine_kwargs.enable_return_routed_experts: true "
                                 "(set false here)")
            self.generator.engine_kwargs["enable_return_routed_experts"] = True
        if self.weightsync.transport == "nccl" and self.learner.num_gpus_per_rank <= 0:
            raise ValueError(
                "weightsync.transport='nccl' needs the learner on GPUs (learner.num_gpus_per_rank > 0); "
                "use 'gloo' for the same broadcast path on CPU hosts"
            )
        return self


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


__all__ = [
    "AlgorithmConfig",
    "AutoscalingConfig",
    "BufferConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataColumns",
    "DataConfig",
    "GeneratorConfig",
    "HybridConfig",
    "JudgeConfig",
    "LearnerConfig",
    "LoggingConfig",
    "ModelConfig",
    "ProfilerConfig",
    "ResourcePool",
    "RewardConfig",
    "RewardModelConfig",
    "RoleOffload",
    "RolloutConfig",
    "RootConfig",
    "TrainerConfig",
    "WandbConfig",
    "WeightsyncConfig",
    "load_config",
    "load_config_file",
]
