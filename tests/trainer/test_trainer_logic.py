"""Pure logic of the training loop: advantages per batch, the prompt stream, metrics files."""

import json
import math

import pytest
import torch

from asyncrl.algorithms import grpo_advantages
from asyncrl.config import AlgorithmConfig
from asyncrl.data.prompts import Prompt
from asyncrl.trainer.data_stream import PromptStream
from asyncrl.trainer.logging_setup import progress_line
from asyncrl.trainer.rollout import request_seed
from asyncrl.trainer.step import compute_advantages, pad_per_token
from asyncrl.trainer.tracking import MetricsTracker
from asyncrl.types import Sample, TrainBatch


def _batch(rewards, groups, lengths):
    samples = [
        Sample(prompt_ids=[1], response_ids=list(range(n)), behavior_logprobs=[-1.0] * n, versions=[0] * n, reward=r, group_id=g, prompt_index=g)
        for r, g, n in zip(rewards, groups, lengths)
    ]
    return TrainBatch(samples=samples, step=0, policy_version=0)


@pytest.mark.parametrize("weight", [0.0, 0.25])
def test_negative_advantages_are_scaled_by_the_configured_weight(weight):
    batch = _batch([1.0, 0.0, 0.0, 1.0], [0, 0, 1, 1], [2, 1, 1, 3])
    lp = [[-1.0] * n for n in (2, 1, 1, 3)]
    plain, _, _ = compute_advantages(batch, AlgorithmConfig(group_size=2), lp, None, None)
    weighted, _, _ = compute_advantages(batch, AlgorithmConfig(group_size=2, negative_advantage_weight=weight), lp, None, None)
    assert plain[1][0] < 0 < plain[0][0]  # one better and one worse sample in each group
    for p_row, w_row in zip(plain, weighted):
        assert w_row == pytest.approx([a * weight if a < 0 else a for a in p_row])


def test_grpo_advantages_are_broadcast_over_each_response():
    batch = _batch([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], [2, 3, 1, 2])
    lp = [[-1.0] * n for n in (2, 3, 1, 2)]
    adv, returns, metrics = compute_advantages(batch, AlgorithmConfig(group_size=2), lp, None, None)
    expected = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1]))
    assert [len(a) for a in adv] == [2, 3, 1, 2]
    assert adv[0] == pytest.approx([float(expected[0])] * 2)
    assert adv[1] == pytest.approx([float(expected[1])] * 3)
    assert adv[2] == [0.0] and adv[3] == [0.0, 0.0]  # all-equal group: no signal
    assert returns is None
    assert metrics["train/response_length"] == 2.0


def test_kl_as_reward_penalty_lowers_the_sample_that_drifted():
    batch = _batch([1.0, 1.0], [0, 0], [2, 2])
    lp = [[-1.0, -1.0], [-1.0, -1.0]]
    ref = [[-1.0, -1.0], [-3.0, -3.0]]  # sample 1 moved away from the reference
    algo = AlgorithmConfig(group_size=2, kl_coef=0.1, kl_mode="reward", kl_kind="k1")
    adv, _, metrics = compute_advantages(batch, algo, lp, ref, None)
    assert adv[0][0] > 0 > adv[1][0]
    assert metrics["train/kl_ref"] == pytest.approx(1.0)
    # as a loss term instead, rewards are untouched
    adv_loss, _, _ = compute_advantages(batch, AlgorithmConfig(group_size=2, kl_coef=0.1, kl_mode="loss"), lp, ref, None)
    assert adv_loss[0] == [0.0, 0.0]


def test_gae_returns_for_ppo():
    batch = _batch([1.0, 0.0], [0, 1], [3, 2])
    lp = [[-1.0] * 3, [-1.0] * 2]
    values = [[0.5, 0.5, 0.5], [0.1, 0.1]]
    algo = AlgorithmConfig(name="ppo", group_size=1, gamma=1.0, lam=1.0)
    adv, returns, _ = compute_advantages(batch, algo, lp, None, values)
    # gamma = lam = 1: the return of every token is the final reward
    assert returns[0] == pytest.approx([1.0, 1.0, 1.0])
    assert returns[1] == pytest.approx([0.0, 0.0])
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(batch, algo, lp, None, None)


def test_per_turn_rewards_add_to_the_return_summed_or_on_each_turns_last_token():
    """An episode's per-turn rewards: GRPO sees reward + their sum; GAE (gamma = lam = 1, zero values) sees
    each on its turn's last sampled token, so the tokens before a turn's end carry that turn's reward and the
    later ones only the rest. Turn ends that do not fit the response are refused."""
    batch = _batch([1.0, 1.0], [0, 0], [4, 4])
    batch.samples[0].turn_rewards, batch.samples[0].turn_ends = [0.5, -2.0], [1, 3]
    lp = [[-1.0] * 4, [-1.0] * 4]
    adv, _, metrics = compute_advantages(batch, AlgorithmConfig(group_size=2), lp, None, None)
    expected = grpo_advantages(torch.tensor([1.0 + 0.5 - 2.0, 1.0], dtype=torch.float64), torch.tensor([0, 0]))
    assert adv[0] == pytest.approx([float(expected[0])] * 4) and adv[0][0] < 0 < adv[1][0]
    assert metrics["train/turn_reward_sum_mean"] == pytest.approx((-1.5 + 0.0) / 2)
    algo = AlgorithmConfig(name="ppo", group_size=1, gamma=1.0, lam=1.0)
    _, returns, _ = compute_advantages(batch, algo, lp, None, [[0.0] * 4, [0.0] * 4])
    assert returns[0] == pytest.approx([-0.5, -0.5, -1.0, -1.0])  # 1 + 0.5 - 2 up to token 1, then 1 - 2
    assert returns[1] == pytest.approx([1.0] * 4)
    batch.samples[0].turn_ends = [1, 4]  # past the response
    with pytest.raises(ValueError, match="turn_ends"):
        compute_advantages(batch, AlgorithmConfig(group_size=2), lp, None, None)


def test_mismatched_lengths_are_rejected():
    batch = _batch([1.0, 0.0], [0, 0], [2, 2])
    with pytest.raises(ValueError, match="logprobs rows"):
        compute_advantages(batch, AlgorithmConfig(group_size=2), [[-1.0], [-1.0, -1.0]], None, None)


def test_pad_per_token_handles_empty_rows():
    values, mask = pad_per_token([[1.0, 2.0], []])
    assert values.tolist() == [[1.0, 2.0], [0.0, 0.0]]
    assert mask.tolist() == [[True, True], [False, False]]


def test_prompt_stream_resumes_exactly_and_reshuffles_per_epoch():
    prompts = [Prompt(prompt=f"q{i}", answer=str(i)) for i in range(5)]
    a = PromptStream(prompts, seed=7)
    first = [a.next() for _ in range(7)]
    state = a.state_dict()
    rest = [a.next() for _ in range(6)]
    b = PromptStream(prompts, seed=7)
    b.load_state_dict(state)
    assert [b.next() for _ in range(6)] == rest
    assert [i for i, _ in first] == list(range(7))  # stream indices are global and unique
    epoch0 = [p.prompt for _, p in first[:5]]
    assert sorted(epoch0) == sorted(p.prompt for p in prompts)
    with pytest.raises(ValueError, match="prompt stream state"):
        PromptStream(prompts[:4], seed=7).load_state_dict(state)


def test_request_seed_is_stable_and_distinct():
    assert request_seed(0, 5) == request_seed(0, 5)
    assert len({request_seed(0, i) for i in range(1000)}) == 1000


def test_tracker_writes_jsonl_tensorboard_and_plot(tmp_path):
    tracker = MetricsTracker(tmp_path, plot_interval_steps=2)
    tracker.log(1, {"train/reward_mean": 0.5, "eval/accuracy": 0.4, "buffer/staleness_mean": 1.0})
    tracker.log(2, {"train/reward_mean": 0.6, "eval/accuracy": math.nan})
    tracker.close()
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2]
    assert lines[1]["eval/accuracy"] is None  # NaN is written as null, the record stays valid JSON
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert any((tmp_path / "tensorboard").iterdir())


def test_progress_line():
    line = progress_line(5, 10, {"train/reward_mean": 0.25, "eval/accuracy": None})
    assert line.startswith("[##########----------] 5/10 reward 0.250 acc -")


def test_the_learner_warm_up_runs_once_per_trainable_group_only_where_asked_inside_the_placement():
    import asyncio
    from types import SimpleNamespace

    from asyncrl.config import load_config
    from asyncrl.trainer.parts import warm_up_learners

    class Group:
        def __init__(self, role, dp):
            self.role, self.layout, self.calls = role, SimpleNamespace(dp=dp), []

        async def warm_up(self, samples):
            self.calls.append([(len(s.prompt_ids), len(s.response_ids), s.group_id) for s in samples])
            return {"learner/warm_up_s": 0.1, "learner/warm_up_tokens": 30.0}

    class Placement:  # the hybrid's switch around the warm-up (`Colocation.warm_up`), recorded
        def __init__(self):
            self.entered = 0

        async def warm_up(self, fn, prepare_push=None):
            self.entered += 1
            self.prepared = prepare_push
            return await fn()

    class Weights:  # WeightPublisher.form_groups, recorded; `fails` as a group that does not form
        def __init__(self, fails=False):
            self.formed, self.fails = 0, fails

        async def form_groups(self):
            self.formed += 1
            if self.fails:
                raise RuntimeError("no group")

    def run(cfg, prompt_tokens=None, placement=None, weights=None):
        actor, critic = Group("actor", 2), Group("critic", 1)
        asyncio.run(warm_up_learners(load_config(cfg), [actor, None, critic], placement or Placement(), prompt_tokens,
                                     weights))
        return actor.calls, critic.calls

    base = {"model": {"max_model_len": 40}, "algorithm": {"max_new_tokens": 16}, "learner": {"micro_batch_size": 3}}
    actor, critic = run(base, prompt_tokens=9)
    # every DP shard gets a full micro-batch of the data's longest prompt + max_new_tokens, one group per sample
    assert actor == [[(9, 16, g) for g in range(6)]] and critic == [[(9, 16, g) for g in range(3)]]
    assert run(base)[0] == [[(24, 16, g) for g in range(6)]]  # no prompt length known: the room the context leaves
    assert run({**base, "learner": {"micro_batch_size": 3, "warm_up": False}}) == ([], [])
    hybrid = {**base, "hybrid": {"enabled": True}, "learner": {"micro_batch_size": 3, "num_gpus_per_rank": 1},
              "generator": {"num_gpus": 1, "engine_kwargs": {"enable_sleep_mode": True}}}
    placement, weights = Placement(), Weights()
    assert run(hybrid, 9, placement, weights) == ([[(9, 16, g) for g in range(6)]], [[(9, 16, g) for g in range(3)]])
    assert placement.entered == 1  # both groups inside one switch
    # ... which forms weightsync's groups too (the first push need not); a failure there is the first push's to redo
    asyncio.run(placement.prepared())
    failing = Weights(fails=True)
    failing_place = Placement()
    run(hybrid, 9, failing_place, failing)
    asyncio.run(failing_place.prepared())
    assert weights.formed == 1 and failing.formed == 1
    separated = Placement()
    run(base, 9, separated, Weights())
    assert separated.prepared is None  # separated: weightsync's start formed them
    unasked = Placement()
    run({**base, "learner": {"micro_batch_size": 3, "warm_up": False}}, placement=unasked)
    assert unasked.entered == 0  # no warm-up: the engines are not put to sleep for nothing
    sglang = Placement()  # SGLang sleeps keeping its weights only with their host backup
    hybrid_sglang = {**hybrid, "generator": {"num_gpus": 1, "engine": "sglang", "engine_kwargs": {"enable_memory_saver": True, "dtype": "float16"}}}
    assert run(hybrid_sglang, 9, sglang) == ([], []) and sglang.entered == 0
    backed = Placement()
    with_backup = {**hybrid, "generator": {"num_gpus": 1, "engine": "sglang",
                                           "engine_kwargs": {"enable_memory_saver": True, "dtype": "float16",
                                                             "enable_weights_cpu_backup": True}}}
    run(with_backup, 9, backed)
    assert backed.entered == 1


def test_a_lora_actor_that_is_also_the_reference_is_started_switched_and_shut_down_once():
    """With learner.lora the actor group answers for the reference (parts._start_learners): every loop over the
    run's groups (start, the placement's others, shutdown) takes each group once."""
    from asyncrl.trainer.parts import distinct

    actor, critic = object(), object()
    assert distinct(actor, actor, critic) == [actor, critic]
    assert distinct(actor, None, critic) == [actor, critic]
    assert distinct(actor, critic, but=actor) == [critic]
    assert distinct(None, None) == []



def test_a_checkpoint_dir_that_a_learner_node_does_not_see_is_refused_naming_it(tmp_path):
    """checkpoint.dir on several nodes (parts.check_shared_checkpoint_dir): a marker the trainer's node writes must
    be visible from every node that runs a learner rank; one that cannot see it fails the start, naming the setting.
    Ranks all on the trainer's node need no check (and leave no marker)."""
    import asyncio
    from pathlib import Path

    from asyncrl.trainer.parts import check_shared_checkpoint_dir

    class Group:
        def __init__(self, *nodes):
            self.nodes = nodes

        async def state(self):
            return [{"rank": i, "node_id": n} for i, n in enumerate(self.nodes)]

    seen: list = []

    def sees_from(visible):
        async def sees(node, path):
            seen.append((node, Path(path).parent == tmp_path, Path(path).exists()))
            return node in visible
        return sees

    groups = [Group("node-a", "node-b"), Group("node-c")]
    asyncio.run(check_shared_checkpoint_dir(str(tmp_path), groups, sees_from({"node-b", "node-c"}), here="node-a"))
    assert seen == [("node-b", True, True), ("node-c", True, True)] and list(tmp_path.iterdir()) == []  # marker gone
    with pytest.raises(RuntimeError, match=r"checkpoint.dir .* is not shared: learner node\(s\) node-c do not see"):
        asyncio.run(check_shared_checkpoint_dir(str(tmp_path), groups, sees_from({"node-b"}), here="node-a"))
    del seen[:]
    asyncio.run(check_shared_checkpoint_dir(str(tmp_path / "local"), [Group("node-a")], sees_from(set()), here="node-a"))
    assert seen == [] and not (tmp_path / "local").exists()
