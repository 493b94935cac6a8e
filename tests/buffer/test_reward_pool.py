"""RewardPool: correct scores, every failure becomes a counted INVALID_REWARD, a stuck worker is
killed and replaced, and bad configuration fails at construction."""

from __future__ import annotations

import pytest

from asyncrl.config import RewardConfig
from asyncrl.rewards import RewardFunctionError, RewardPool, RewardPoolError
from asyncrl.types import SampleStatus

MOD = "tests.buffer._rewards"


@pytest.mark.slow
async def test_scores_and_every_misbehaviour_is_invalid_never_zero():
    pool = RewardPool(RewardConfig(function=f"{MOD}:by_command", timeout_s=30, num_workers=2))
    try:
        cmds = ["abc", "raise", "none", "nan", "inf", "string", "hello"]
        out = await pool.score(cmds, ["1", "1", "1", "1", "1", "1", "10"], [{} for _ in cmds])
        assert out[0] == (4.0, SampleStatus.VALID, None)
        assert out[-1] == (15.0, SampleStatus.VALID, None)
        for o in out[1:-1]:
            assert o.status == SampleStatus.INVALID_REWARD and o.reward is None and o.error
        assert "boom from the reward function" in out[1].error
        assert "None" in out[2].error and "nan" in out[3].error and "str" in out[5].error
        m = pool.metrics()
        assert (m["reward/calls"], m["reward/invalid"], m["reward/errors"], m["reward/timeouts"]) == (7, 5, 2, 0)
        assert m["reward/worker_starts"] <= 2  # healthy workers are reused
    finally:
        pool.close()
    with pytest.raises(RewardPoolError, match="closed"):
        await pool.score(["abc"], ["1"])


@pytest.mark.slow
async def test_stuck_or_dying_worker_is_killed_and_replaced():
    # One worker: if the looping call wedged it, the calls after it could never run.
    pool = RewardPool(RewardConfig(function=f"{MOD}:by_command", timeout_s=2.0, num_workers=1))
    try:
        out = await pool.score(["loop", "ab", "die", "abcd"], ["0", "1", "0", "1"])
        assert out[0].status == SampleStatus.INVALID_REWARD and "timed out" in out[0].error
        assert out[1] == (3.0, SampleStatus.VALID, None)
        assert out[2].status == SampleStatus.INVALID_REWARD and "worker died" in out[2].error
        assert out[3] == (5.0, SampleStatus.VALID, None)
        m = pool.metrics()
        assert (m["reward/timeouts"], m["reward/errors"], m["reward/invalid"]) == (1, 1, 2)
        assert m["reward/worker_starts"] == 3  # the first, and one replacement per killed worker
    finally:
        pool.close()


@pytest.mark.slow
async def test_default_math_reward():
    pool = RewardPool(RewardConfig(num_workers=1))
    try:
        out = await pool.score(["so 3 + 4 = 7", "it is 8", "no idea"], ["7", "7", "7"])
        assert [o.reward for o in out] == [1.0, 0.0, 0.0]
    finally:
        pool.close()


@pytest.mark.parametrize(
    "path, match",
    [
        ("no_colon_here", "module:function"),
        ("a:b:c", "module:function"),
        ("no.such.module_xyz:f", "cannot import"),
        (f"{MOD}:missing", "no attribute"),
        (f"{MOD}:NOT_CALLABLE", "not callable"),
    ],
)
def test_bad_function_path_fails_at_construction(path, match):
    with pytest.raises(RewardFunctionError, match=match):
        RewardPool(RewardConfig(function=path))


async def test_bad_arguments_raise_before_any_work():
    pool = RewardPool(RewardConfig(function=f"{MOD}:length_reward"))
    with pytest.raises(ValueError, match="lengths differ"):
        await pool.score(["a", "b"], ["1"])
    with pytest.raises(TypeError):
        await pool.score(["a"], [1])
    with pytest.raises(ValueError, match="start_method"):
        RewardPool(RewardConfig(), start_method="fork")
    assert pool.metrics()["reward/worker_starts"] == 0
    pool.close()
