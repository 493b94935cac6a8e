"""The group's Megatron-compute dispatch over real layouts against TP=1: TP=2, DP=2, PP=2, PP=2 x VPP=2,
TP=2 with sequence parallelism, CP=2, TP=2 x CP=2, and packed sequences (TP=1 and CP=2).

Eleven actor groups (Ray rank actors; Megatron over gloo on CPU, over NCCL with a GPU per rank on a GPU
host) get the same batch: their log-probs (which must also match `transformers`), their first
update's loss and grad norm, and the log-probs after that update must agree. The groups run one after another (two GPUs
hold one two-rank group at a time); each reports what it computed, then its export, then stops.
The interleaved (VPP) schedule runs twice: with 3 micro-batches of unequal shapes (a contiguous
group of 3, since 3 % 2 would leave a group smaller than PP) and with 1 micro-batch (padded to PP
with an empty one).
"""

from __future__ import annotations

import pytest

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.group import LearnerGroup
from tests.learner._data import advantages, make_samples, max_diff, run, with_behavior
from tests.learner._device import assert_placement, fits, num_gpus_per_rank, placement

pytestmark = pytest.mark.slow

VPP2 = {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}
TP2_SP = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
CP2 = {"context_parallel_size": 2}
# name: (world size, strategy_config, micro_batch_size[, other LearnerConfig fields]); 8 samples
LAYOUTS = {
    "tp1": (1, {}, 3),
    "tp2": (2, {"tensor_model_parallel_size": 2}, 3),
    "dp2": (2, {}, 3),
    # Megatron's distributed optimizer: each DP rank steps half of the fp32 state; the grad norm summed over DP
    "dp2_sharded": (2, {}, 3, {"memory": {"optimizer": "sharded"}}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}, 3),
    "vpp2": (2, VPP2, 3),
    "vpp2_one_mb": (2, VPP2, 8),
    "tp2_sp": (2, TP2_SP, 3),
    "cp2": (2, CP2, 3),
    "tp2_cp2": (4, {"tensor_model_parallel_size": 2, "context_parallel_size": 2}, 3),
    # packed rows: 3 sequences of one micro-batch back to back; attention must stay in each one
    "tp1_packed": (1, {}, 3, {"sequence_packing": True}),
    "cp2_packed": (2, CP2, 3, {"sequence_packing": True}),
}
# Layouts whose update is handed no proximal log-probs: its first forward gives them (the policy
# denominator's capped tokens counted over DP, the rescale sent to every PP stage).
FROM_UPDATE = {"dp2", "dp2_sharded", "pp2", "vpp2", "tp2_sp", "cp2_packed"}


def _export(group: LearnerGroup) -> dict:
    import ray

    from tests.weightsync.fakes import iter_unpacked

    packed = run(group.export_weights(bucket_mb=1.0))
    return {n: t.clone() for n, t in iter_unpacked(ray.get(packed.buckets))}


@pytest.fixture(scope="module")
def runs(ray_session, demo_model_path) -> dict[str, dict]:
    """Per layout (tp1 first: its log-probs are every group's behaviour and old log-probs): where its
    ranks ran, its log-probs, its first update's metrics, its log-probs after it, and its export."""
    import torch

    model = ModelConfig(path=str(demo_model_path))
    algo = AlgorithmConfig(group_size=2)
    samples = make_samples()
    adv = advantages(samples)
    adv[0] = [0.3 * (j + 1) for j in range(len(adv[0]))]  # not a plain sign pattern
    out: dict[str, dict] = {}
    for name, (ws, strategy, mbs, *extra) in LAYOUTS.items():
        if not fits(ws) or (name.endswith("_sharded") and not torch.cuda.is_available()):
            continue  # e.g. tp2_cp2's four NCCL ranks on a two-GPU host; a sharded optimizer needs CUDA
        group = LearnerGroup("actor", model, LearnerConfig(
            world_size=ws, strategy_config=strategy, lr=1e-4, micro_batch_size=mbs, num_cpus_per_rank=0.5,
            num_gpus_per_rank=num_gpus_per_rank(ws), **(extra[0] if extra else {}),
        ), algo)
        run(group.start())
        try:
            r = {"placement": placement(group), "lp": run(group.compute_log_prob(samples))}
            base = out["tp1"]["lp"] if out else r["lp"]
            # every third token's behaviour 2 nats below: pi_prox / pi_behave = e^2, masked by the cap (5)
            behaved = with_behavior(samples, [[x - 2.0 if t % 3 == 0 else x for t, x in enumerate(row)] for row in base])
            r["metrics"] = run(group.update_actor(behaved, adv, None if name in FROM_UPDATE else base))
            r["after"] = run(group.compute_log_prob(samples))
            r["export"] = _export(group)
        finally:
            run(group.shutdown())
        out[name] = r
    return out


def test_every_rank_ran_on_the_expected_backend(runs):
    for name, r in runs.items():
        assert len(r["placement"]) == LAYOUTS[name][0], name
        assert_placement(r["placement"])


def test_every_layout_matches_transformers(runs, demo_model_path):
    """fp32: the fused attention (sdpa spec), SP's sequence-sharded norms, CP's zig-zag chunks with
    gathered K/V, and packed rows all give transformers' log-probs."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.learner._data import hf_logprobs

    hf = AutoModelForCausalLM.from_pretrained(str(demo_model_path), dtype=torch.float32).eval()
    ref = hf_logprobs(hf, make_samples())
    for name, r in runs.items():
        assert max_diff(r["lp"], ref) < 1e-4, name


def test_logprobs_and_one_update_agree_across_layouts(runs):
    # dp2: re-assembled in sample order; pp2 / vpp2: collected from the last (virtual) stage.
    lp = {name: r["lp"] for name, r in runs.items()}
    others = [name for name in runs if name != "tp1"]  # the layouts this host's devices can hold
    for name in others:
        assert max_diff(lp[name], lp["tp1"]) < 1e-4, name

    base = runs["tp1"]["metrics"]
    for name in others:
        m = runs[name]["metrics"]
        assert m["actor/pg_loss"] == pytest.approx(base["actor/pg_loss"], rel=1e-4, abs=1e-7), name
        assert m["actor/grad_norm"] == pytest.approx(base["actor/grad_norm"], rel=1e-3), name
        assert m["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5), name  # update forward = old forward
        assert m["actor/applied_steps"] == 1.0
        assert m["actor/behavior_capped_tokens"] > 0, name  # (a mean over micro-batches: layouts split unlike)
        assert m["actor/proximal_from_update"] == float(name in FROM_UPDATE), name
        # mismatch sums over every micro-batch and DP rank, read on the last stage
        assert m["mismatch/tokens"] == base["mismatch/tokens"], name
        assert m["mismatch/out_of_band_frac"] == pytest.approx(base["mismatch/out_of_band_frac"]), name
        assert m["mismatch/abs_diff_max"] == pytest.approx(2.0, abs=1e-3), name
    assert base["actor/behavior_capped_tokens"] > 0
    after = {name: r["after"] for name, r in runs.items()}
    assert max_diff(after["tp1"], lp["tp1"]) > 1e-3  # the step did move the policy
    for name in others:  # pp2 / vpp2: tied embedding grads synced over PP
        assert max_diff(after[name], after["tp1"]) < 1e-3, name


def test_export_gathers_every_stage_and_shard(runs):
    import torch

    base = runs["tp1"]["export"]
    for name in ("tp2", "pp2", "vpp2"):
        got = runs[name]["export"]
        assert set(got) == set(base), name
        # Same update on every layout: weights agree up to Adam's first-step rounding.
        assert max((got[k] - base[k]).abs().max().item() for k in base) < 5e-4, name
    assert all(torch.isfinite(t).all() for t in base.values())


@pytest.fixture(scope="module")
def critic_runs(ray_session, demo_model_path) -> dict[str, dict]:
    """A critic (scalar value head) at TP=1, PP=2 and PP=2 x VPP=2: its values, one update, values after."""
    model = ModelConfig(path=str(demo_model_path))
    samples = make_samples()
    returns = [[0.5 if s.reward > 0 else -0.5] * len(s.response_ids) for s in samples]
    out: dict[str, dict] = {}
    for name in ("tp1", "pp2", "vpp2", "tp2_sp", "cp2"):
        ws, strategy, mbs = LAYOUTS[name]
        group = LearnerGroup("critic", model, LearnerConfig(
            world_size=ws, strategy_config=strategy, lr=1e-3, micro_batch_size=mbs, num_cpus_per_rank=0.5,
            num_gpus_per_rank=num_gpus_per_rank(ws),
        ), AlgorithmConfig(name="ppo", group_size=2))
        run(group.start())
        try:
            values = run(group.compute_values(samples))
            out[name] = {"values": values, "metrics": run(group.update_critic(samples, returns, values)),
                         "after": run(group.compute_values(samples))}
        finally:
            run(group.shutdown())
    return out


def test_a_pipelined_critic_computes_and_updates_like_tp1(critic_runs):
    """Under PP the value head sits on the last (virtual) stage and the embedding is untied on every
    stage: a first stage still tied waited forever in the embedding-grad all-reduce (the update hung)."""
    base = critic_runs["tp1"]
    assert max_diff(base["after"], base["values"]) > 1e-3
    for name in ("pp2", "vpp2", "tp2_sp", "cp2"):
        r = critic_runs[name]
        assert max_diff(r["values"], base["values"]) < 1e-4, name
        assert r["metrics"]["critic/vf_loss"] == pytest.approx(base["metrics"]["critic/vf_loss"], rel=1e-4), name
        # Adam's first step moves every weight by about lr whatever its gradient's size, so gradients
        # that differ by rounding (other reduction orders under TP/SP/CP) can move a weight the
        # other way: up to ~2e-3 seen on one CPU; a wrong layout is off by orders more.
        assert max_diff(r["after"], base["after"]) < 3e-3, name


def test_a_pool_no_node_offers_is_named_while_waiting_and_when_the_wait_ends(ray_session, demo_model_path):
    """A learner placement group that asks for a resource no live node has: while Ray holds it pending,
    `waits_now` (behind /train/status's `waiting_for`) names learner.pool and why; past the group's call
    timeout the start fails saying the same, and nothing is left waiting or placed."""
    import asyncio

    from asyncrl.cluster import waits_now
    from asyncrl.types import LearnerRankError

    learner = LearnerConfig(world_size=2, num_cpus_per_rank=0.5, pool={"resources": {"nowhere_node": 1}})
    group = LearnerGroup("actor", ModelConfig(path=str(demo_model_path)), learner, AlgorithmConfig(), call_timeout_s=4.0)

    async def start_and_look():
        task = asyncio.ensure_future(group.start())
        await asyncio.sleep(1.5)
        seen = waits_now()
        with pytest.raises(LearnerRankError) as err:
            await task
        return seen, err.value

    seen, err = run(start_and_look())
    assert [(w["pool"], w["asks"], w["why"]) for w in seen] == [
        ("learner.pool", "2 x {CPU: 0.5, nowhere_node: 1}", "no live node offers {CPU: 0.5, nowhere_node: 1}")]
    assert seen[0]["for_s"] >= 1.0
    assert "learner.pool: no live node offers {CPU: 0.5, nowhere_node: 1}" in str(err)
    assert waits_now() == [] and group._pg is None and group.ranks == []
