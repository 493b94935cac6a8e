"""The remote reward pool's client (asyncrl/rewards/remote.py): a call its actor died in is retried on the
actor Ray starts again, counted, at most reward.max_restarts times; past that the actor's error raises.
(The real thing, a node lost: tests/e2e/test_multinode.py.)"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from asyncrl.config import RewardConfig
from asyncrl.rewards.remote import RemoteRewardPool


class _Score:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures, self.calls = failures, 0

    def remote(self, completions, answers, metadata):
        self.calls += 1

        async def answer():
            if self.failures:
                raise self.failures.pop(0)
            return [float(c == a) for c, a in zip(completions, answers)]

        return answer()


def _pool(max_restarts: int, failures: list[BaseException]) -> RemoteRewardPool:
    pool = RemoteRewardPool.__new__(RemoteRewardPool)  # the client's logic alone: no actor started
    pool.config, pool.retries = RewardConfig(pool={"labels": {"pool": "reward"}}, max_restarts=max_restarts), 0
    pool.actor = type("Actor", (), {"score": _Score(failures)})()
    return pool


def test_a_call_the_actor_died_in_is_retried_and_counted():
    pool = _pool(3, [ActorDiedError(), ActorUnavailableError("restarting", None)])
    assert asyncio.run(pool.score(["1", "2"], ["1", "1"])) == [1.0, 0.0]
    assert pool.actor.score.calls == 3 and pool.metrics() == {"reward/worker_retries": 2.0}


def test_past_max_restarts_the_actors_error_raises():
    pool = _pool(1, [ActorDiedError(), ActorDiedError()])
    with pytest.raises(ActorDiedError):
        asyncio.run(pool.score(["1"], ["1"]))
    assert pool.actor.score.calls == 2 and pool.metrics() == {"reward/worker_retries": 1.0}
    pool = _pool(0, [ActorDiedError()])
    with pytest.raises(ActorDiedError):
        asyncio.run(pool.score(["1"], ["1"]))
    assert pool.actor.score.calls == 1 and pool.retries == 0


def test_max_restarts_is_validated():
    with pytest.raises(ValueError, match="max_restarts"):
        RewardConfig(max_restarts=-1)
