"""The learner rank as the Ray actor `LearnerGroup` starts (`rank.actor_class`): its calls run one at a time, except
`take_host_copies`, which waits for the last push's host copies beside them. In hybrid placement the params' release
follows the push at once, and the next step's training follows it: neither may queue behind the copies."""

from __future__ import annotations

import threading

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.parallel import RankCoords
from asyncrl.learner.rank import LearnerRank, actor_class


class _Endpoint:
    """A sending rank's endpoint whose host copies are made once `done` is set."""

    plan = None

    def __init__(self) -> None:
        self.done = threading.Event()

    def take_host_copies(self, timeout_s: float, sender: int = 0):
        if not self.done.wait(timeout_s):
            raise TimeoutError("the host copies were never made")
        return f"copies of sender {sender}"


class _Rank(LearnerRank):
    def __init__(self) -> None:
        super().__init__(0, 1, "actor", ModelConfig(), LearnerConfig(), AlgorithmConfig(), role_classes={"actor": object})
        self.coords, self._sender = RankCoords(rank=0, tp=0, cp=0, dp=0, pp=0), _Endpoint()

    def copies_made(self) -> bool:  # a call in the default group, as release_device / call are
        self._sender.done.set()
        return True


def test_a_call_behind_take_host_copies_runs_while_the_copies_are_still_being_made(ray_session):
    ray = ray_session
    rank = actor_class(_Rank).remote()
    try:
        copies = rank.take_host_copies.remote(60.0)  # waits until the next call says the copies are made
        # In the actor's one default thread this call would wait behind the copies, which wait for it: timeout.
        assert ray.get(rank.copies_made.remote(), timeout=30) is True
        assert ray.get(copies, timeout=30) == "copies of sender 0"
    finally:
        ray.kill(rank)


def test_the_rank_class_stays_plain_for_tests_without_ray():
    rank = _Rank()
    rank.copies_made()
    assert rank.take_host_copies(1.0) == "copies of sender 0"

