"""LearnerGroup._gather's rule for failures, as pure logic over awaitables: any failure leaves the group
unusable, except errors the call names survivable (a weight broadcast whose receiver died) when every rank
answered and each failure has one in its chain; then that error is raised and the group goes on. The real
case on gloo: tests/weightsync/test_learner_wire_failure.py."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.learner.group import LearnerGroup
from asyncrl.types import LearnerRankError
from asyncrl.weightsync.collective import CollectiveError


def _group(timeout_s: float = 0.5) -> LearnerGroup:
    group = LearnerGroup.__new__(LearnerGroup)  # no ranks started: _gather only awaits what it is given
    group.call_timeout_s, group._broken, group._broken_rank = timeout_s, None, None
    return group


async def _ok():
    return "ok"


async def _raise(err: BaseException):
    raise err


async def _hang():
    await asyncio.sleep(30)


def _wrapped(err: BaseException) -> RuntimeError:
    """A remote error whose cause is `err`, as Ray raises it."""
    outer = RuntimeError(f"ray::LearnerRank failed: {err}")
    outer.cause = err
    return outer


def _run(group: LearnerGroup, refs, survivable=()):
    return asyncio.run(group._gather("export_weights", refs, survivable=survivable))


def test_a_wire_failure_on_every_failing_rank_is_raised_as_itself_and_the_group_goes_on():
    group = _group()
    with pytest.raises(CollectiveError, match="rank 1 in export_weights: .*connection closed") as err:
        _run(group, [_ok(), _raise(_wrapped(CollectiveError("connection closed")))], survivable=(CollectiveError,))
    assert not isinstance(err.value, LearnerRankError) and group._broken is None
    assert _run(group, [_ok(), _ok()]) == ["ok", "ok"]  # still usable


@pytest.mark.parametrize("second", ["other error", "no answer"])
def test_anything_else_beside_it_leaves_the_group_unusable(second):
    group = _group()
    other = _raise(_wrapped(ValueError("export failed"))) if second == "other error" else _hang()
    with pytest.raises(LearnerRankError):
        _run(group, [_raise(_wrapped(CollectiveError("connection closed"))), other], survivable=(CollectiveError,))
    assert group._broken is not None
    # refused before it awaits anything, naming the rank that broke it (a run that fails says which)
    with pytest.raises(LearnerRankError, match="learner rank 0 failed in export_weights: group unusable after an earlier failure"):
        _run(group, [])


def test_a_call_that_names_nothing_survivable_breaks_on_a_wire_failure_too():
    group = _group()
    with pytest.raises(LearnerRankError):
        _run(group, [_raise(_wrapped(CollectiveError("connection closed")))])
    assert group._broken == "rank 0 failed in export_weights"
