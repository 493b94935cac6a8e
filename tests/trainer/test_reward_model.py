"""reward.kind model against the real thing: a reward model trained from the demo policy
(`asyncrl demo-reward-model`, a few steps), loaded by the reward_model role into a Megatron rank
actor, scoring the policy's token ids as transformers scores them; a rank killed mid-run costs one
pass (INVALID_REWARD with the reason) and the group comes back."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import ray
import torch

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig, RewardConfig
from asyncrl.data.prompts import Prompt, render_prompt
from asyncrl.rewards.model import ModelRewards, RewardModelError, check_reward_model
from asyncrl.types import SampleStatus

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reward_model_dir(tiny_reward_model):
    return tiny_reward_model


def _pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    out = []
    for a, b, said in [(12, 34, "46"), (12, 34, "47"), (5, 70, "75"), (99, 1, "1"), (40, 40, "80")]:
        prompt = render_prompt(tokenizer, Prompt(prompt=f"What is {a} + {b}?", answer=str(a + b)))
        out.append((tokenizer(prompt, add_special_tokens=False)["input_ids"],
                    tokenizer(said + tokenizer.eos_token, add_special_tokens=False)["input_ids"]))
    return out


def test_the_role_scores_token_ids_as_transformers_does_and_comes_back_after_a_rank_dies(ray_session, reward_model_dir, demo_model_path):
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from asyncrl.demo_reward_model import last_token_scores

    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    pairs = _pairs(tokenizer)
    hf = Qwen2ForSequenceClassification.from_pretrained(reward_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = last_token_scores(hf, [(p, r, 0.0, []) for p, r in pairs], tokenizer.pad_token_id).tolist()

    cfg = RewardConfig(kind="model", model={"path": str(reward_model_dir), "max_wait_s": 0.0, "max_restarts": 1})
    learner = LearnerConfig(world_size=1, micro_batch_size=4, num_cpus_per_rank=0.5)
    scorer = ModelRewards(cfg, ModelConfig(path=str(demo_model_path)), learner, AlgorithmConfig(group_size=2))

    async def go():
        await scorer.start()
        first = await scorer.score(["x"] * len(pairs), ["0"] * len(pairs), token_ids=pairs)
        ray.kill(scorer._group.ranks[0], no_restart=True)
        lost = await scorer.score(["x"], ["0"], token_ids=pairs[:1])
        again = await scorer.score(["x"] * len(pairs), ["0"] * len(pairs), token_ids=pairs)
        metrics = scorer.metrics()
        await scorer.aclose()
        return first, lost, again, metrics

    first, lost, again, metrics = asyncio.run(go())
    assert all(o.status == SampleStatus.VALID for o in first + again)
    got = [o.reward for o in first]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4, (got, want)
    assert len(set(round(x, 4) for x in got)) == len(got)  # each sequence its own score, from the trained head
    assert lost[0].status == SampleStatus.INVALID_REWARD and "reward model pass failed" in lost[0].error
    assert [o.reward for o in again] == pytest.approx(got, abs=1e-5)  # the restarted group loaded the same model
    assert metrics["reward/model_restarts"] == 1 and metrics["reward/model_failures"] == 1
    assert metrics["reward/model_valid"] == 2 * len(pairs) and metrics["reward/model_down"] == 0


def test_check_reward_model_accepts_it_and_names_a_wrong_label_count_or_tokenizer(reward_model_dir, demo_model_path, tmp_path):
    check_reward_model(str(reward_model_dir), str(demo_model_path))
    two = tmp_path / "two"
    shutil.copytree(reward_model_dir, two)
    config = json.loads((two / "config.json").read_text())
    config["id2label"], config["label2id"] = {"0": "a", "1": "b"}, {"a": 0, "b": 1}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(RewardModelError, match="num_labels=2"):
        check_reward_model(str(two), str(demo_model_path))
    other = tmp_path / "other"
    shutil.copytree(reward_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # two digits swap ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(RewardModelError, match="tokenizer differs from the policy's"):
        check_reward_model(str(other), str(demo_model_path))
