"""The remote reward pool's client (asyncrl/rewards/remote.py): a call its actor died in is retried on the
actor Ray starts again, counted, at most reward.max_restarts times; past that the actor's error raises. While Ray
says the actor is being started again, the call waits for it (one restart, however many tries).
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
    assert pool.actor.score.calls == 3 and pool.metrics() == {"reward/worker_retries": 1.0}  # (one call retried)


def test_an_actor_still_restarting_is_waited_for_without_spending_the_restarts(monkeypatch):
    """A node lost: Ray answers 'unavailable' every try until the actor runs again elsewhere. Those tries are one
    restart (the CI saw two of them on a loaded machine), so even max_restarts 1 outlasts many; past the wait, the
    call fails saying so."""
    import asyncrl.rewards.remote as remote

    monkeypatch.setattr(remote, "UNAVAILABLE_RETRY_S", 0.01)
    restarting = [ActorUnavailableError("restarting", None) for _ in range(5)]
    pool = _pool(1, [ActorDiedError(), *restarting])
    assert asyncio.run(pool.score(["1"], ["1"])) == [1.0]
    assert pool.actor.score.calls == 7 and pool.retries == 1
    monkeypatch.setattr(remote, "RESTART_WAIT_S", 0.1)
    pool = _pool(1, [ActorUnavailableError("restarting", None) for _ in range(1000)])
    with pytest.raises(TimeoutError, match="not running again within 0.1 s"):
        asyncio.run(pool.score(["1"], ["1"]))


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


def test_a_retry_names_the_pool_while_it_waits_and_gives_up_with_a_clear_error(monkeypatch):
    """The retried call waits for Ray to start the actor again: meanwhile `waits_now` (/train/status) names
    reward.pool; a pool with no node left (the call never answered) fails it after RESTART_WAIT_S, saying so."""
    import asyncrl.rewards.remote as remote
    from asyncrl.cluster import NodeOffer, waits_now

    monkeypatch.setattr(remote, "RESTART_WAIT_S", 0.5)
    pool = _pool(3, [ActorDiedError()])
    never = asyncio.Event()

    class Hung(_Score):
        def remote(self, completions, answers, metadata):
            self.calls += 1
            if self.failures:
                return super().remote(completions, answers, metadata)
            return never.wait()  # the restarted actor never comes: no node of the pool left

    pool.actor.score = Hung([ActorDiedError()])

    async def go():
        task = asyncio.ensure_future(pool.score(["1"], ["1"]))
        await asyncio.sleep(0.2)
        seen = waits_now([NodeOffer("head0000", {"CPU": 2.0}, {"pool": "head"})])
        with pytest.raises(TimeoutError) as err:
            await task
        return seen, str(err.value)

    seen, err = asyncio.run(go())
    assert [(w["pool"], w["why"]) for w in seen] == [("reward.pool", "no live node offers {CPU: 0.1} on labels {pool=reward}")]
    assert "reward.pool: the reward actor was lost and not running again within 0.5 s" in err
    assert pool.retries == 1 and waits_now([]) == []
