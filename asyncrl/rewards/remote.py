"""The reward workers on a node of their own pool: the same `RewardPool`, hosted by one Ray actor.

Owns: the actor (`RewardWorkers`, async, placed by `reward.pool`) that runs a `RewardPool` and its
worker processes on its node, and `RemoteRewardPool`, the client with RewardPool's interface
(`score`, `close`) that the trainer holds instead of an in-process pool.
Must never: score anything itself, or change what an outcome means: every failure inside the
actor is the pool's INVALID_REWARD as before. The actor's death (its node lost): Ray starts it again
on the pool (`reward.max_restarts`) and the call is retried there (scoring is a pure function of its
inputs); past that the call raises.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
log = logging.getLogger(__name__)
RESTART_WAIT_S = 300.0  # how long a retried call waits for the actor Ray starts again
UNAVAILABLE_RETRY_S = 0.5  # between a call's tries while Ray says the actor is being started again


class RemoteRewardPool:
    """RewardPool's interface over a `RewardWorkers` actor placed on `config.pool`'s nodes."""

    def __init__(self, config: RewardConfig) -> None:
        resolve_reward_function(config.function)  # a bad path fails here too, before an actor starts
        self.config = config
        self.retries = 0  # calls retried after the actor died (its node lost), over the pool's life
        # max_task_retries 0: a call the dead actor held fails here, counted and retried by `score`
        self.actor = RewardWorkers.options(num_cpus=config.num_cpus, max_restarts=config.max_restarts, max_task_retries=0,
                                           **config.pool.actor_options()).remote(config)

    async def score(self, completions: list[str], answers: list[str], metadata: list[dict[str, Any]] | None = None,
                    token_ids: TokenIds | None = None) -> list[RewardOutcome]:
        """The pool's outcomes; a call the actor died in is retried on the actor Ray starts again (at most
        `reward.max_restarts` deaths a call); past that, or once Ray gives the actor up, the error raises. While the
        actor is being started again (Ray answers it is unavailable) the call waits for it, up to RESTART_WAIT_S:
        a restart that takes a while is one restart, not several."""
        from ray.exceptions import ActorUnavailableError, RayActorError  # (ActorDiedError is one too)

        from asyncrl.cluster import reward_demand, waiting_for

        deaths, deadline = 0, None
        while True:
            try:
                if deadline is None:
                    return await self.actor.score.remote(completions, answers, metadata)
                # a retry waits for Ray to start the actor again: /train/status names reward.pool meanwhile, and a
                # pool with no node left fails the call instead of holding the rollout for ever
                with waiting_for(reward_demand(self.config), "the reward actor is starting again"):
                    return await asyncio.wait_for(self.actor.score.remote(completions, answers, metadata),
                                                  max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise TimeoutError(f"reward.pool: the reward actor was lost and not running again within {RESTART_WAIT_S:g} s "
                                   "(no node of the pool left to start it on?)") from None
            except RayActorError as err:  # the call waits for the restart; a given-up actor fails it at once
                restarting = isinstance(err, ActorUnavailableError)
                if self.config.max_restarts == 0 or (not restarting and deaths == self.config.max_restarts):
                    raise
                if deadline is None:  # (counted once a call)
                    self.retries += 1
                if not restarting:
                    deaths += 1
                if not restarting or deadline is None:  # a new restart to wait for
                    deadline = time.monotonic() + RESTART_WAIT_S
                    log.warning("reward actor lost (%s); retrying the call on its restart (%d of %d)",
                                type(err).__name__, max(deaths, 1), self.config.max_restarts)
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"reward.pool: the reward actor was lost and not running again within "
                                       f"{RESTART_WAIT_S:g} s (no node of the pool left to start it on?)") from None
                if restarting:
                    await asyncio.sleep(UNAVAILABLE_RETRY_S)

    def metrics(self) -> dict[str, float]:
        """The client's own counter (the workers' counters stay in their actor)."""
        return {"reward/worker_retries": float(self.retries)}

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
