"""The group's Megatron-compute dispatch over real layouts: TP=2, DP=2 and PP=2 against TP=1.

Four actor groups (1 + 2 + 2 + 2 Ray rank actors; Megatron over gloo on CPU, over NCCL with a GPU
per rank on a GPU host) get the same batch: their log-probs, their first update's loss and grad
norm, and the log-probs after that update must agree. The groups run one after another (two GPUs
hold one two-rank group at a time); each reports what it computed, then its export, then stops.
"""

from __future__ import annotations

import pytest

from asyncrl.config import AlgorithmConfig, LearnerConfig, ModelConfig
from asyncrl.learner.group import LearnerGroup
from tests.learner._data import advantages, make_samples, max_diff, run, with_behavior
from tests.learner._device import assert_placement, num_gpus_per_rank, placement

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tp1": (1, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "dp2": (2, {}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
}


def _export(group: LearnerGroup) -> dict:
    import ray

    from asyncrl.weightsync.bucket import iter_unpacked

    packed = run(group.export_hf_tensors_packed(bucket_mb=1.0))
    return {n: t.clone() for n, t in iter_unpacked(ray.get(packed.buckets))}


@pytest.fixture(scope="module")
def runs(ray_session, demo_model_path) -> dict[str, dict]:
    """Per layout (tp1 first: its log-probs are every group's behaviour and old log-probs): where its
    ranks ran, its log-probs, its first update's metrics, its log-probs after it, and its export."""
    model = ModelConfig(path=str(demo_model_path))
    algo = AlgorithmConfig(group_size=2)
    samples = make_samples()
    adv = advantages(samples)
    adv[0] = [0.3 * (j + 1) for j in range(len(adv[0]))]  # not a plain sign pattern
    out: dict[str, dict] = {}
    for name, (ws, strategy) in LAYOUTS.items():
        group = LearnerGroup("actor", model, LearnerConfig(
            world_size=ws, strategy_config=strategy, lr=1e-4, micro_batch_size=3, num_cpus_per_rank=0.5,
            num_gpus_per_rank=num_gpus_per_rank(ws),
        ), algo)
        run(group.start())
        try:
            r = {"placement": placement(group), "lp": run(group.compute_log_prob(samples))}
            base = out["tp1"]["lp"] if out else r["lp"]
            r["metrics"] = run(group.update_actor(with_behavior(samples, base), adv, base))
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


def test_logprobs_and_one_update_agree_across_layouts(runs):
    lp = {name: r["lp"] for name, r in runs.items()}
    assert max_diff(lp["tp2"], lp["tp1"]) < 1e-4
    assert max_diff(lp["dp2"], lp["tp1"]) < 1e-4  # re-assembled in sample order
    assert max_diff(lp["pp2"], lp["tp1"]) < 1e-4  # collected from the last stage

    base = runs["tp1"]["metrics"]
    for name in ("tp2", "dp2", "pp2"):
        m = runs[name]["metrics"]
        assert m["actor/pg_loss"] == pytest.approx(base["actor/pg_loss"], rel=1e-4, abs=1e-7), name
        assert m["actor/grad_norm"] == pytest.approx(base["actor/grad_norm"], rel=1e-3), name
        assert m["actor/applied_steps"] == 1.0
    after = {name: r["after"] for name, r in runs.items()}
    assert max_diff(after["tp1"], lp["tp1"]) > 1e-3  # the step did move the policy
    assert max_diff(after["tp2"], after["tp1"]) < 1e-3
    assert max_diff(after["dp2"], after["tp1"]) < 1e-3
    assert max_diff(after["pp2"], after["tp1"]) < 1e-3  # tied embedding grads synced over PP


def test_export_gathers_every_stage_and_shard(runs):
    import torch

    base = runs["tp1"]["export"]
    for name in ("tp2", "pp2"):
        got = runs[name]["export"]
        assert set(got) == set(base), name
        # Same update on every layout: weights agree up to Adam's first-step rounding.
        assert max((got[k] - base[k]).abs().max().item() for k in base) < 5e-4, name
    assert all(torch.isfinite(t).all() for t in base.values())
