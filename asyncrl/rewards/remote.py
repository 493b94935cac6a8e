"""The reward workers on a node of their own pool: the same `RewardPool`, hosted by one Ray actor.

Owns: the actor (`RewardWorkers`, async, placed by `reward.pool`) that runs a `RewardPool` and its
worker processes on its node, and `RemoteRewardPool`, the client with RewardPool's interface
(`score`, `close`) that the trainer holds instead of an in-process pool.
Must never: score anything itself, or change what an outcome means: every failure inside the
actor is the pool's INVALID_REWARD as before; only the actor's own death (its node lost) raises.
"""

from __future__ import annotations

from typing import Any

import ray

from asyncrl.config import RewardConfig
from asyncrl.rewards.pool import RewardOutcome, RewardPool, TokenIds, resolve_reward_function


class RewardWorkersService:
    """A RewardPool inside an async Ray actor (one event loop, as the pool requires)."""

    def __init__(self, config: RewardConfig) -> None:
        self._pool = RewardPool(config)

    async def score(self, completions: list[str], answers: list[str], metadata: list[dict[str, Any]] | None = None,
                    token_ids: TokenIds | None = None) -> list[RewardOutcome]:
        return await self._pool.score(completions, answers, metadata)

    def metrics(self) -> dict[str, float]:
        return self._pool.metrics()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self._pool.close()


RewardWorkers = ray.remote(RewardWorkersService)


class RemoteRewardPool:
    """RewardPool's interface over a `RewardWorkers` actor placed on `config.pool`'s nodes."""

    def __init__(self, config: RewardConfig) -> None:
        resolve_reward_function(config.function)  # a bad path fails here too, before an actor starts
        self.config = config
        self.actor = RewardWorkers.options(num_cpus=config.num_cpus, **config.pool.actor_options()).remote(config)

    async def score(self, completions: list[str], answers: list[str], metadata: list[dict[str, Any]] | None = None,
                    token_ids: TokenIds | None = None) -> list[RewardOutcome]:
        return await self.actor.score.remote(completions, answers, metadata)

    async def node_id(self) -> str:
        return await self.actor.node_id.remote()

    def close(self) -> None:
        """Kill the worker processes, then end the actor; returns at once (its node may be gone: the
        worker processes also exit when the actor's end of their pipes closes)."""
        self.actor.close.remote()
        self.actor.__ray_terminate__.remote()


def reward_pool(config: RewardConfig) -> Any:
    """The trainer's reward scorer: a judge model over HTTP (reward.kind http), or the rule function in
    in-process workers, or in an actor on `reward.pool`'s nodes."""
    if config.kind == "http":
        from asyncrl.rewards.judge import HttpJudge

        return HttpJudge(config)
    return RemoteRewardPool(config) if config.pool.is_set() else RewardPool(config)
