"""What holds only where a config trains: checks of the full app that load a component.

Owns: `check_trainable`, run when the full app is built (a generator-only app may serve what the
trainer refuses, e.g. a 16-bit model on CPU). The checks load the agent function, the reward
model's directory and the evaluation rule, so they live beside the trainer and not in config.py,
which imports no component.

Must never: start a process or touch the cluster (cluster.py's checks do that).
"""

from __future__ import annotations

from asyncrl.config import ConfigError, RootConfig
from asyncrl.rewards.model import RewardModelError, check_reward_model
from asyncrl.rewards.pool import RewardFunctionError, resolve_reward_function
from asyncrl.trainer.agent import AgentFunctionError, load_agent_function


def check_trainable(cfg: RootConfig) -> None:
    """What holds only where this config trains (the full app; a generator-only app may serve a 16-bit
    model on CPU): raises ConfigError."""
    if cfg.rollout.kind == "agent":
        try:
            load_agent_function(cfg.rollout.function or "")
        except AgentFunctionError as err:
            raise ConfigError(str(err)) from None
    if cfg.rollout.kind == "agent" and cfg.reward.kind == "rule" and cfg.reward.function != type(cfg.reward).model_fields["function"].default:
        raise ConfigError(f"reward.function={cfg.reward.function!r} with rollout.kind='agent': the agent function "
                          "(rollout.function) returns each episode's reward; a rule does not score episodes "
                          "(reward.kind model or http does, with the agent returning None)")
    if cfg.reward.kind == "model":
        try:
            check_reward_model(cfg.reward.model.path, cfg.model.path)
        except RewardModelError as err:
            raise ConfigError(f"reward.model.path: {err}") from None
    if cfg.reward.eval_function:
        try:
            resolve_reward_function(cfg.reward.eval_function, what="reward.eval_function")
        except RewardFunctionError as err:
            raise ConfigError(str(err)) from None
    if cfg.model.dtype != "float32" and cfg.learner.num_gpus_per_rank <= 0:
        raise ConfigError(
            f"model.dtype={cfg.model.dtype!r} with the learner on CPU (learner.num_gpus_per_rank=0): Megatron's "
            "mixed-precision optimizer keeps 16-bit weights on CUDA devices only; use float32 on CPU hosts")
