"""ModelRewards' own logic (reward.kind model) against a scripted group: passes gathered across
concurrent callers, failures as INVALID_REWARD with the reason, restarts, going down for good, and
the config's checks. The real reward-model group is in tests/trainer/test_reward_model.py."""

from __future__ import annotations

import asyncio
import math

import pytest

from asyncrl.config import AlgorithmConfig, ConfigError, LearnerConfig, ModelConfig, RewardConfig, load_config
from asyncrl.rewards.model import ModelRewards, RewardModelError, check_reward_model
from asyncrl.trainer.checks import check_trainable
from asyncrl.types import SampleStatus


class ScriptedGroup:
    """compute_rm_score returns len(response) + 0.5 per sample, or what `plan` says for a pass."""

    started = 0

    def __init__(self, passes: list, plan: dict | None = None) -> None:
        self.passes, self.plan = passes, plan or {}

    async def start(self) -> None:
        ScriptedGroup.started += 1
        if self.plan.get("start_fails"):
            raise RuntimeError("no placement")

    async def compute_rm_score(self, samples):
        self.passes.append(len(samples))
        await asyncio.sleep(0.01)
        action = self.plan.get("fail_pass")
        if action is not None and len(self.passes) in action:
            raise RuntimeError("rank 0 died")
        if self.plan.get("nan"):
            return [math.nan for _ in samples]
        return [len(s.response_ids) + 0.5 for s in samples]

    async def shutdown(self) -> None:
        pass


def scorer(passes: list, *, plan=None, **rm) -> ModelRewards:
    cfg = RewardConfig(kind="model", model={"path": "/nowhere", **rm})
    return ModelRewards(cfg, ModelConfig(), LearnerConfig(), AlgorithmConfig(), group_factory=lambda: ScriptedGroup(passes, plan))


def ids(n: int, length: int = 3) -> list[tuple[list[int], list[int]]]:
    return [([1, 2], list(range(length))) for _ in range(n)]


def test_concurrent_callers_share_passes_of_at_most_batch_size():
    passes: list[int] = []

    async def go():
        s = scorer(passes, batch_size=8, max_wait_s=0.2)
        await s.start()
        outs = await asyncio.gather(*(s.score(["x"] * 4, ["1"] * 4, token_ids=ids(4, length=k + 1)) for k in range(5)))
        await s.aclose()
        return outs, s.metrics()

    outs, metrics = asyncio.run(go())
    assert sorted(passes) == [4, 8, 8]  # 20 completions, at most 8 a pass, not 5 passes of 4
    assert [[o.reward for o in out] for out in outs] == [[k + 1.5] * 4 for k in range(5)]  # each caller its own scores
    assert metrics["reward/model_passes"] == 3 and metrics["reward/model_valid"] == 20 and metrics["reward/model_mean_pass_size"] == 20 / 3


def test_a_failed_pass_is_invalid_with_its_reason_and_the_group_restarts():
    passes: list[int] = []
    ScriptedGroup.started = 0

    async def go():
        s = scorer(passes, plan={"fail_pass": {1}}, max_wait_s=0.0, max_restarts=1, sigmoid=True)
        await s.start()
        first = await s.score(["x"] * 2, ["1"] * 2, token_ids=ids(2))
        second = await s.score(["x"], ["1"], token_ids=ids(1, length=1))
        empty = await s.score(["x"], ["1"], token_ids=[([1], [])])
        await s.aclose()
        return first, second, empty, s.metrics()

    first, second, empty, metrics = asyncio.run(go())
    assert [o.status for o in first] == [SampleStatus.INVALID_REWARD] * 2 and first[0].reward is None
    assert "rank 0 died" in first[0].error
    assert second[0].status == SampleStatus.VALID and second[0].reward == pytest.approx(1 / (1 + math.exp(-1.5)))
    assert empty[0].status == SampleStatus.INVALID_REWARD and "empty response" in empty[0].error
    assert ScriptedGroup.started == 2 and metrics["reward/model_restarts"] == 1 and metrics["reward/model_failures"] == 1
    assert metrics["reward/model_down"] == 0.0


def test_past_max_restarts_every_score_is_invalid_with_the_reason():
    passes: list[int] = []

    async def go():
        s = scorer(passes, plan={"fail_pass": {1, 2}}, max_wait_s=0.0, max_restarts=1)
        await s.start()
        a = await s.score(["x"], ["1"], token_ids=ids(1))
        b = await s.score(["x"], ["1"], token_ids=ids(1))
        c = await s.score(["x"], ["1"], token_ids=ids(1))  # no pass: the scorer is down
        await s.aclose()
        return a, b, c, s.metrics()

    a, b, c, metrics = asyncio.run(go())
    assert a[0].status == b[0].status == c[0].status == SampleStatus.INVALID_REWARD
    assert "down after 1 restarts" in c[0].error and "rank 0 died" in c[0].error
    assert passes == [1, 1] and metrics["reward/model_down"] == 1.0


def test_a_non_finite_score_is_invalid_and_token_ids_are_required():
    async def go():
        s = scorer([], plan={"nan": True}, max_wait_s=0.0)
        await s.start()
        out = await s.score(["x"], ["1"], token_ids=ids(1))
        with pytest.raises(ValueError, match="token_ids"):
            await s.score(["x"], ["1"])
        await s.aclose()
        return out

    out = asyncio.run(go())
    assert out[0].status == SampleStatus.INVALID_REWARD and "not a finite number" in out[0].error


def test_config_names_what_is_missing_or_wrong(demo_model_path, tmp_path):
    with pytest.raises(ConfigError, match="reward.model.path|needs model.path"):
        load_config({"reward": {"kind": "model"}})
    with pytest.raises(ConfigError, match="reward.pool places rule workers only"):
        load_config({"reward": {"kind": "model", "model": {"path": "x"}, "pool": {"resources": {"rw": 1}}}})
    # An agent returns its own reward, unless a reward model or judge scores its episodes: a rule it would skip is refused.
    agent = load_config({"reward": {"kind": "rule", "function": "tests.somewhere:my_rule"},
                         "rollout": {"kind": "agent", "function": "asyncrl.agents.arithmetic:two_step"}})
    with pytest.raises(ConfigError, match="returns each episode's reward; a rule does not score episodes"):
        check_trainable(agent)
    check_trainable(load_config({"rollout": {"kind": "agent", "function": "asyncrl.agents.arithmetic:two_step"}}))
    # The policy's own directory: a causal LM, no score head.
    cfg = load_config({"reward": {"kind": "model", "model": {"path": str(demo_model_path)}}})
    with pytest.raises(ConfigError, match="reward.model.path: .*has no score.weight"):
        check_trainable(cfg)
    with pytest.raises(ConfigError, match="reward.eval_function 'nope:f'"):
        check_trainable(load_config({"reward": {"eval_function": "nope:f"}}))


def test_check_reward_model_wants_an_hf_directory(tmp_path, demo_model_path):
    with pytest.raises(RewardModelError, match="no config.json"):
        check_reward_model(str(tmp_path), str(demo_model_path))


def test_demo_reward_model_cli_names_a_missing_policy_and_a_bad_step_count(tmp_path, capsys):
    from asyncrl.cli import build_parser, main

    assert main(["demo-reward-model", "--policy", str(tmp_path / "none"), "--out", str(tmp_path / "rm")]) == 2
    assert "is not a model directory (no config.json)" in capsys.readouterr().err
    assert not (tmp_path / "rm").exists()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo-reward-model", "--out", "x", "--steps", "0"])
    assert "--steps" in capsys.readouterr().err
