"""Actor, reference, critic and reward-model roles in real Ray rank actors (world_size=1; Megatron
over gloo on CPU, over NCCL on a share of one GPU on a GPU host).

One group per role for the whole module; tests run in file order and build on each other's
state (the actor's weights move forward), each asserting what it changed.
"""

from __future__ import annotations

import math
import time

import pytest
import ray
import torch

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.group import LearnerGroup
from asyncrl.types import LearnerRankError
from tests.learner._data import VOCAB, advantages, hf_logprobs, make_samples, max_diff, run, with_behavior
from tests.learner._device import assert_placement, num_gpus_per_rank, placement

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def groups(ray_session, demo_model_path):
    model = ModelConfig(path=str(demo_model_path))
    learner = LearnerConfig(world_size=1, lr=1e-4, micro_batch_size=3, num_cpus_per_rank=0.5,
                            num_gpus_per_rank=num_gpus_per_rank(1))
    algo = AlgorithmConfig(group_size=2)
    # The reference packs sequences under a token budget: its log-probs must still match.
    ref_learner = learner.model_copy(update={"sequence_packing": True, "max_tokens_per_micro_batch": 40})
    critic_learner = learner.model_copy(update={"lr": 1e-3})
    g = {
        "actor": LearnerGroup("actor", model, learner, algo),
        "reference": LearnerGroup("reference", model, ref_learner, algo),
        "critic": LearnerGroup("critic", model, critic_learner, AlgorithmConfig(name="ppo", group_size=2)),
        "reward_model": LearnerGroup("reward_model", model, learner, algo),
        # learner.lora: adapters on every linear, the base frozen
        "lora": LearnerGroup("actor", model, LearnerConfig.model_validate(
            {**learner.model_dump(), "lr": 1e-3, "lora": {"rank": 4, "alpha": 8}}), algo),
    }

    async def start():
        import asyncio

        await asyncio.gather(*(x.start() for x in g.values()))

    run(start())
    for x in g.values():
        placement(x)  # TF32 off in the ranks before any parity check
    yield g
    for x in g.values():
        run(x.shutdown())


@pytest.fixture(scope="module")
def hf_model(demo_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(demo_model_path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def state():
    return {}


def test_every_rank_ran_on_the_expected_backend(groups):
    for g in groups.values():
        assert_placement(placement(g))


def test_logprobs_match_transformers(groups, hf_model, state):
    samples = make_samples()
    want = hf_logprobs(hf_model, samples)
    actor = run(groups["actor"].compute_log_prob(samples))
    ref = run(groups["reference"].compute_ref_log_prob(samples))
    assert [len(r) for r in actor] == [len(s.response_ids) for s in samples]
    assert max_diff(actor, want) < 1e-4
    assert max_diff(ref, want) < 1e-4  # packed + token-budget micro-batches
    entropy = run(groups["actor"].compute_entropy(samples))
    assert all(0 < e <= math.log(284) + 1e-4 for row in entropy for e in row)
    state["initial"] = actor


def test_the_warm_up_makes_the_optimizer_state_and_changes_nothing_the_update_reads(groups, state):
    """learner.warm_up before the first update: one zero-loss forward-backward of a micro-batch (3 samples of 5 + 7
    tokens, padded into one row each) and Adam's state made; the weights and the step count stay, and a second
    warm-up (the state exists: a resumed run's) leaves the optimizer alone."""
    from asyncrl.config import load_config
    from asyncrl.trainer.parts import warm_up_samples

    cfg = load_config({"model": {"max_model_len": 12}, "algorithm": {"max_new_tokens": 7}, "learner": {"micro_batch_size": 3}})
    samples = warm_up_samples(cfg, dp=1, prompt_tokens=5)
    assert [(len(s.prompt_ids), len(s.response_ids)) for s in samples] == [(5, 7)] * 3
    assert {len(s.prompt_ids) for s in warm_up_samples(cfg, dp=2, prompt_tokens=50)} == {5}  # at most the room left
    m = run(groups["actor"].warm_up(samples))
    assert m["learner/warm_up_optimizer"] == 1.0 and m["learner/warm_up_tokens"] == 3 * 12 and m["learner/warm_up_s"] > 0
    assert run(groups["actor"].compute_log_prob(make_samples())) == state["initial"]
    assert run(groups["actor"].state())[0]["metrics"]["actor/applied_steps"] == 0.0
    assert run(groups["actor"].warm_up(samples))["learner/warm_up_optimizer"] == 0.0


def test_actor_update_lowers_loss_and_reference_stays(groups, state):
    samples = with_behavior(make_samples(), state["initial"])
    ref_before = run(groups["reference"].compute_ref_log_prob(samples))
    losses = []
    for _ in range(4):
        m = run(groups["actor"].update_actor(samples, advantages(samples), state["initial"], ref_before))
        losses.append(m["actor/pg_loss"])
        assert m["actor/step_skipped"] == 0.0 and math.isfinite(m["actor/grad_norm"])
    assert losses[-1] < losses[0] - 1e-3, losses
    after = run(groups["actor"].compute_log_prob(samples))
    assert max_diff(after, state["initial"]) > 1e-3
    assert run(groups["reference"].compute_ref_log_prob(samples)) == ref_before


def test_nan_step_is_skipped_and_leaves_params(groups):
    samples = make_samples()
    before = run(groups["actor"].compute_log_prob(samples))
    adv = advantages(samples)
    adv[2][1] = float("nan")
    m = run(groups["actor"].update_actor(with_behavior(samples, before), adv, before))
    assert m["actor/step_skipped"] == 1.0
    assert m["actor/skipped_steps"] == 1.0
    assert run(groups["actor"].compute_log_prob(samples)) == before


def test_a_release_with_the_engines_wake_need_reaches_the_rank(groups):
    """hybrid `learner_offload: when_short`: the wake need travels group -> rank with the release; a role
    with nothing flagged to offload decides nothing (its state never leaves the device)."""
    held = run(groups["actor"].hold_device())
    assert [a["holds"] for a in held] == [{"params": 1, "grads": 1, "optimizer": 1}]
    out = run(groups["actor"].release_device(None, (0.3, 1 << 30)))
    assert [(a["rank"], a["report"], a["holds"]) for a in out] == [(0, {}, {"params": 0, "grads": 0, "optimizer": 0})]


def test_export_reloads_into_transformers(groups, hf_model, state):
    from transformers import AutoModelForCausalLM

    from tests.weightsync.fakes import iter_unpacked

    packed = run(groups["actor"].export_weights(bucket_mb=0.5))
    assert len(packed.buckets) > 1  # 0.5 MiB buckets: the 3.3 MB model needs several
    tensors = {n: t.clone() for n, t in iter_unpacked(ray.get(packed.buckets))}
    initial = hf_model.state_dict()
    assert set(tensors) <= set(initial) and "model.embed_tokens.weight" in tensors
    assert any(not torch.equal(t, initial[n]) for n, t in tensors.items())
    updated = AutoModelForCausalLM.from_pretrained(hf_model.config._name_or_path, dtype=torch.float32).eval()
    missing, unexpected = updated.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    updated.tie_weights()
    samples = make_samples()
    assert max_diff(hf_logprobs(updated, samples), run(groups["actor"].compute_log_prob(samples))) < 1e-4


def test_checkpoint_roundtrip_and_the_updates_own_proximal_pass(groups, tmp_path):
    """A checkpoint restores the actor exactly; from it, an update handed no proximal log-probs (its first
    forward gives them) lands where the update handed them landed, decoupled-PPO-capped tokens included
    (their count is only known after that forward: the policy grads are rescaled to the true denominator)."""
    samples = make_samples()
    saved = run(groups["actor"].compute_log_prob(samples))
    # every third token's behaviour log-prob 2 below the proximal one: pi_prox / pi_behave = e^2 > the cap, 5
    behaved = with_behavior(samples, [[lp - 2.0 if t % 3 == 0 else lp for t, lp in enumerate(row)] for row in saved])
    steps_before = run(groups["actor"].state())[0]["metrics"]["actor/applied_steps"]
    run(groups["actor"].save_checkpoint(str(tmp_path / "ckpt")))
    handed = run(groups["actor"].update_actor(behaved, advantages(samples), saved))
    after_handed = run(groups["actor"].compute_log_prob(samples))
    assert max_diff(after_handed, saved) > 1e-4
    run(groups["actor"].load_checkpoint(str(tmp_path / "ckpt")))
    assert max_diff(run(groups["actor"].compute_log_prob(samples)), saved) < 1e-6
    assert run(groups["actor"].state())[0]["metrics"]["actor/lr"] == pytest.approx(1e-4)
    assert steps_before >= 4
    gaps = [[i % 3] * len(s.response_ids) for i, s in enumerate(samples)]  # samples 0, 3, 6: gap 0; ...
    own = run(groups["actor"].update_actor(behaved, advantages(samples), None, None, gaps))
    assert handed["actor/proximal_from_update"] == 0.0 and own["actor/proximal_from_update"] == 1.0
    # the engine/learner mismatch: d = log pi_prox - log pi_behave is 2 on every third token, 0 elsewhere
    lengths = [len(s.response_ids) for s in samples]
    n, n3 = sum(lengths), sum(len(range(0, k, 3)) for k in lengths)
    for m in (handed, own):
        assert m["mismatch/tokens"] == n and m["mismatch/out_of_band_frac"] == pytest.approx(n3 / n)
        assert m["mismatch/abs_diff_max"] == pytest.approx(2.0, abs=1e-4)
        assert m["mismatch/k1"] == pytest.approx(-2.0 * n3 / n, abs=1e-4)
    assert "mismatch/gap0/tokens" not in handed  # no version gaps given
    assert [own[f"mismatch/gap{g}/tokens"] for g in ("0", "1", "2+")] == [sum(lengths[i::3]) for i in range(3)]
    assert own["actor/behavior_capped_tokens"] == handed["actor/behavior_capped_tokens"] > 0
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/loss"):
        assert own[k] == pytest.approx(handed[k], rel=1e-5, abs=1e-7), k
    # float32 rounding of log-probs near -20 (the grads are scaled after they are summed, not before)
    assert max_diff(run(groups["actor"].compute_log_prob(samples)), after_handed) < 2e-5


def test_a_critic_saved_before_any_step_loads_back_into_a_warmed_one(groups, tmp_path):
    """A save before the first optimizer step still loads, also into an optimizer that has made its state since
    (the trainer's warm-up): the save makes a fresh optimizer's state first (else the checkpoint holds none for the
    load to read), and the load gives back Megatron's step of 0, which its save leaves out."""
    samples = make_samples()
    assert run(groups["critic"].state())[0]["metrics"]["critic/applied_steps"] == 0.0
    before = run(groups["critic"].compute_values(samples))
    run(groups["critic"].save_checkpoint(str(tmp_path / "fresh")))
    run(groups["critic"].warm_up(samples))
    run(groups["critic"].load_checkpoint(str(tmp_path / "fresh")))
    assert max_diff(run(groups["critic"].compute_values(samples)), before) < 1e-6


def test_critic_fits_fixed_returns(groups):
    samples = make_samples()
    returns = [[0.5 if s.reward > 0 else -0.5] * len(s.response_ids) for s in samples]
    losses = []
    for _ in range(12):
        values = run(groups["critic"].compute_values(samples))
        m = run(groups["critic"].update_critic(samples, returns, values))
        losses.append(m["critic/vf_loss"])
    print("critic losses", losses)
    assert losses[-1] < 0.3 * losses[0], losses


def test_critic_checkpoint_roundtrip_keeps_the_value_head(groups, tmp_path):
    samples = make_samples()
    saved = run(groups["critic"].compute_values(samples))
    run(groups["critic"].save_checkpoint(str(tmp_path / "critic")))
    returns = [[1.0] * len(s.response_ids) for s in samples]
    run(groups["critic"].update_critic(samples, returns, saved))
    assert max_diff(run(groups["critic"].compute_values(samples)), saved) > 1e-4
    run(groups["critic"].load_checkpoint(str(tmp_path / "critic")))
    assert max_diff(run(groups["critic"].compute_values(samples)), saved) < 1e-6


def test_reward_model_scores_each_sequence_at_its_last_token(groups):
    import msgspec

    samples = make_samples()
    scores = run(groups["reward_model"].compute_rm_score(samples))
    assert len(scores) == len(samples) and all(isinstance(x, float) and math.isfinite(x) for x in scores)
    assert len(set(scores)) > 1  # the (random) head reads each sequence, not a constant
    assert run(groups["reward_model"].compute_rm_score(samples)) == scores
    # Only sample 0's last token changes (same lengths, so the same micro-batch padding).
    last = samples[0].response_ids[-1]
    changed = [msgspec.structs.replace(samples[0], response_ids=samples[0].response_ids[:-1] + [last % (VOCAB - 1) + 1])]
    again = run(groups["reward_model"].compute_rm_score(changed + samples[1:]))
    assert abs(again[0] - scores[0]) > 1e-6
    assert max(abs(a - b) for a, b in zip(again[1:], scores[1:])) < 1e-6


def test_rank_error_names_the_rank(groups):
    with pytest.raises(LearnerRankError, match="rank 0.*compute_values"):
        run(groups["reference"].compute_values(make_samples()))


def test_lora_actor_trains_its_adapters_exports_merged_weights_and_checkpoints_them(groups, hf_model, state, tmp_path):
    """learner.lora through the actor role (Megatron DDP, its optimizer over the adapters alone): it starts as the
    base model (B = 0), updates lower the loss, the export carries W + (alpha / r) B A for the adapted linears only
    (transformers on the exported weights gives the actor's log-probs), and a checkpoint holds the adapters."""
    from tests.weightsync.fakes import iter_unpacked

    lora = groups["lora"]
    samples = with_behavior(make_samples(), state["initial"])
    assert max_diff(run(lora.compute_log_prob(samples)), state["initial"]) < 1e-5  # B = 0: the base model
    losses = [run(lora.update_actor(samples, advantages(samples), state["initial"]))["actor/pg_loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3, losses
    trained = run(lora.compute_log_prob(samples))
    assert max_diff(trained, state["initial"]) > 1e-3
    # the KL reference of a LoRA actor is its own frozen base (adapters off): the initial policy, no second copy
    assert max_diff(run(lora.compute_ref_log_prob(samples)), state["initial"]) < 1e-5
    assert max_diff(run(lora.compute_log_prob(samples)), trained) == 0.0  # adapters back on
    packed = run(lora.export_weights(bucket_mb=0.5))
    tensors = {n: t.clone() for n, t in iter_unpacked(ray.get(packed.buckets))}
    initial = hf_model.state_dict()
    changed = {n for n, t in tensors.items() if not torch.equal(t, initial[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed), sorted(changed)  # norms, embeddings frozen
    updated = type(hf_model).from_pretrained(hf_model.config._name_or_path, dtype=torch.float32).eval()
    updated.load_state_dict(tensors, strict=False)
    updated.tie_weights()
    assert max_diff(hf_logprobs(updated, samples), trained) < 1e-4
    run(lora.save_checkpoint(str(tmp_path / "lora")))
    run(lora.update_actor(samples, advantages(samples), state["initial"]))
    assert max_diff(run(lora.compute_log_prob(samples)), trained) > 1e-4
    run(lora.load_checkpoint(str(tmp_path / "lora")))  # the adapters (and their optimizer state) come back
    assert max_diff(run(lora.compute_log_prob(samples)), trained) < 1e-6
    with pytest.raises(LearnerRankError, match="written with learner.lora"):
        run(groups["actor"].load_checkpoint(str(tmp_path / "lora")))  # a full-parameter learner refuses it

    # `asyncrl export`'s conversion: the merged model, and the adapters as PEFT's directory, which PEFT loads
    from peft import PeftModel

    from asyncrl.learner.convert_cli import mcore_to_hf

    model_dir = hf_model.config._name_or_path
    mcore_to_hf(str(tmp_path / "lora"), str(tmp_path / "merged"), model_dir, peft_out=str(tmp_path / "adapter"))
    merged = type(hf_model).from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert max_diff(hf_logprobs(merged, samples), trained) < 1e-4
    base = type(hf_model).from_pretrained(model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert max_diff(hf_logprobs(peft, samples), trained) < 1e-4

    # a run started from that adapter (learner.lora.init_from) starts where this one stands
    cfg = LearnerConfig.model_validate({**lora.learner_cfg.model_dump(), "lora": {
        "rank": 4, "alpha": 8, "init_from": str(tmp_path / "adapter")}})
    resumed = LearnerGroup("actor", lora.model_cfg, cfg, lora.algorithm_cfg)
    try:
        run(resumed.start())
        assert max_diff(run(resumed.compute_log_prob(samples)), trained) < 1e-5
    finally:
        run(resumed.shutdown())



def test_dead_ranks_names_a_killed_rank(groups):
    """LearnerGroup.dead_ranks (the loop's test of whether a lost Ray object was the learner's): none while every
    rank answers, the index of one that was killed. (The last test here: it kills the reward model's rank.)"""
    assert all(run(g.dead_ranks()) == [] for g in groups.values())
    doomed = groups["reward_model"]
    ray.kill(doomed.ranks[0], no_restart=True)  # (asynchronous: a call right after it may still be answered)
    deadline, dead = time.monotonic() + 60, []
    while time.monotonic() < deadline and not dead:
        dead = run(doomed.dead_ranks(timeout_s=30))
        time.sleep(0.5)
    assert dead == [0]
