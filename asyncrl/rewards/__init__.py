"""Rewards: rule functions (run sandboxed with timeouts by the pool) and the reward-model client.

A rule reward is `fn(completion: str, answer: str, metadata: dict) -> float | None`; None or NaN
marks the sample invalid (it is counted, never silently scored 0).
"""

from asyncrl.rewards.pool import RewardFunctionError, RewardOutcome, RewardPool, RewardPoolError, resolve_reward_function

__all__ = ["RewardFunctionError", "RewardOutcome", "RewardPool", "RewardPoolError", "resolve_reward_function"]
