"""A learner rank that fails mid-step (trainer.max_restarts): the learner is started again and the
step redone on the same batch; past the limit, or for any other error, the step fails and names
what failed. Nothing is published for a failed attempt. (The whole loop with a killed rank:
tests/e2e/test_training_loop.py.)"""

from __future__ import annotations

import types

import pytest

from asyncrl.config import RootConfig
from asyncrl.trainer.loop import Trainer
from asyncrl.types import LearnerRankError, learner_failure
from asyncrl.weightsync.push import Step, WeightsyncError


class Placement:
    async def to_learner(self):
        return {}

    async def to_engines(self, publish):
        return await publish()


def _trainer(max_restarts: int, learn_failures: list[BaseException], publish_failures: list[BaseException]):
    calls: list[tuple[str, int]] = []

    async def publish(version):
        if publish_failures:
            raise publish_failures.pop(0)
        calls.append(("publish", version))
        return {"weightsync/version": float(version)}

    async def restart_learners(version):
        calls.append(("restart", version))
        return 4  # the checkpoint it loaded

    parts = types.SimpleNamespace(start_version=5, placement=Placement(), publish=publish, restart_learners=restart_learners)
    trainer = Trainer(RootConfig.model_validate({"trainer": {"max_restarts": max_restarts}}), parts)

    async def learn(batch):
        calls.append(("learn", trainer.version))
        if learn_failures:
            raise learn_failures.pop(0)
        return {"actor/loss": 0.5}

    trainer._learn = learn
    return trainer, calls


def _rank_died(rank: int = 1) -> LearnerRankError:
    try:
        raise RuntimeError("ActorDiedError: the actor died unexpectedly")
    except RuntimeError as cause:
        try:
            raise LearnerRankError(rank, "update_actor", str(cause)) from cause
        except LearnerRankError as err:
            return err


async def test_a_rank_failing_in_the_update_restarts_the_learner_and_redoes_the_step_on_the_same_batch():
    trainer, calls = _trainer(1, [_rank_died()], [])
    metrics, _ = await trainer._train_and_publish(batch=None)
    assert calls == [("learn", 5), ("restart", 5), ("learn", 5), ("publish", 6)]  # published once, as the next version
    assert metrics["trainer/learner_restarts"] == 1.0 and trainer.status()["learner_restarts"] == 1


async def test_a_rank_failing_inside_the_push_counts_too():
    # The sending rank died mid-broadcast: the push fails at its export step, with the rank's error behind it.
    try:
        raise WeightsyncError("weight push of version 6 failed at step export", version=6, step=Step.EXPORT) from _rank_died(0)
    except WeightsyncError as err:
        push_failed = err
    assert learner_failure(push_failed) is push_failed.__cause__
    trainer, calls = _trainer(2, [], [push_failed])
    await trainer._train_and_publish(batch=None)
    assert calls == [("learn", 5), ("restart", 5), ("learn", 5), ("publish", 6)]


async def test_past_max_restarts_or_for_other_errors_the_step_fails_naming_what_failed():
    trainer, calls = _trainer(1, [_rank_died(1), _rank_died(3)], [])
    with pytest.raises(LearnerRankError, match="learner rank 3 failed in update_actor"):
        await trainer._train_and_publish(batch=None)
    assert ("publish", 6) not in calls and calls.count(("restart", 5)) == 1
    trainer, calls = _trainer(0, [_rank_died(2)], [])  # the default: no restart
    with pytest.raises(LearnerRankError, match="rank 2"):
        await trainer._train_and_publish(batch=None)
    assert calls == [("learn", 5)]
    trainer, calls = _trainer(3, [ValueError("a bad batch")], [])  # not a learner failure: never restarted
    with pytest.raises(ValueError, match="a bad batch"):
        await trainer._train_and_publish(batch=None)
    assert calls == [("learn", 5)]
    assert learner_failure(ValueError("x")) is None


async def test_an_object_lost_with_a_dead_learner_rank_restarts_the_learner_and_other_losses_fail_the_step():
    """A version's bucket that a learner rank put dies with the rank's node (Ray's OwnerDiedError, seen once in CI
    ending the run with it bare): with a learner rank gone it is the learner's failure (restart); with every rank
    alive (an engine's object, say) it stays the step's error."""
    from ray.exceptions import OwnerDiedError

    class Group:
        def __init__(self, dead):
            self.dead = dead

        async def dead_ranks(self):
            return self.dead

    def lost():
        try:
            raise WeightsyncError("weight push of version 6 failed at step export", version=6, step=Step.EXPORT) \
                from OwnerDiedError("ffff0001", "owner gone", "")
        except WeightsyncError as err:
            return err

    trainer, calls = _trainer(1, [], [lost()])
    trainer.p.actor, trainer.p.critic = Group([]), Group([1])  # the critic's rank 1 is gone
    await trainer._train_and_publish(batch=None)
    assert calls == [("learn", 5), ("restart", 5), ("learn", 5), ("publish", 6)]
    trainer, calls = _trainer(1, [], [lost()])
    trainer.p.actor = Group([])  # every learner rank answers: not the learner's
    with pytest.raises(WeightsyncError, match="step export"):
        await trainer._train_and_publish(batch=None)
    assert calls == [("learn", 5)]


def test_max_restarts_is_validated():
    with pytest.raises(ValueError, match="max_restarts"):
        RootConfig.model_validate({"trainer": {"max_restarts": -1}})


async def test_a_rank_failing_while_writing_a_checkpoint_restarts_the_learner_and_skips_that_checkpoint():
    trainer, calls = _trainer(1, [], [])

    async def save_checkpoint(version):
        calls.append(("save", version))
        raise _rank_died(0)

    trainer.p.save_checkpoint = save_checkpoint
    await trainer._save_checkpoint()  # not raised: restarted, and this version's checkpoint skipped
    assert calls == [("save", 5), ("restart", 5)] and trainer.restarts == 1
    with pytest.raises(LearnerRankError, match="rank 0 failed"):  # the one restart is spent
        await trainer._save_checkpoint()
