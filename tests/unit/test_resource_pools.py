"""Resource pools: their config fields, the options they become, and the check against a cluster's
nodes (plain dicts of node resources and labels; the same check runs on `ray.nodes()` at app build)."""

from __future__ import annotations

import pytest

from asyncrl.cluster import NodeOffer, PoolUnavailable, check_pools, selector_matches
from asyncrl.config import ConfigError, load_config


def _nodes() -> list[NodeOffer]:
    """A head node, an inference node (labels) and a training node (a custom resource)."""
    return [
        NodeOffer("head0000aaaa", {"CPU": 2.0, "memory": 1e9, "node:127.0.0.1": 1.0}, {"ray.io/node-id": "h", "pool": "head"}),
        NodeOffer("infer000bbbb", {"CPU": 2.0}, {"pool": "inference"}),
        NodeOffer("train000cccc", {"CPU": 2.0, "trainer_node": 1.0}, {"pool": "training"}),
    ]


def _cfg(**sections: dict):
    base = {"learner": {"world_size": 2, "num_cpus_per_rank": 0.5, "strategy_config": {"tensor_model_parallel_size": 2}}}
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return load_config(base, source="test")


def test_pools_become_ray_options():
    cfg = _cfg(generator={"engine_pool": {"labels": {"pool": "inference"}}, "gateway_pool": {"resources": {"head": 0.01}}},
               learner={"pool": {"resources": {"trainer_node": 0.5}}, "placement_strategy": "strict_pack"})
    from asyncrl.generator.deployment import engine_deployment_options

    opts = engine_deployment_options(cfg.generator)["ray_actor_options"]
    assert opts == {"num_cpus": 0.5, "num_gpus": 0.0, "label_selector": {"pool": "inference"}}
    assert cfg.generator.gateway_pool.actor_options() == {"resources": {"head": 0.01}}
    assert cfg.trainer.pool.actor_options() == {} and not cfg.reward.pool.is_set()


@pytest.mark.parametrize("section, values, field, words", [
    ("generator", {"engine_pool": {"resources": {"GPU": 1}}}, "generator.engine_pool.resources", "num_cpus / num_gpus"),
    ("learner", {"pool": {"resources": {"trainer_node": -1}}}, "learner.pool.resources", "positive"),
    ("learner", {"pool": {"resources": {"trainer_node": 1.5}}}, "learner.pool.resources", "fraction only below 1"),
    ("reward", {"pool": {"labels": {"pool": "a b"}}}, "reward.pool.labels", "not a label selector"),
    ("trainer", {"pool": {"nodes": ["x"]}}, "trainer.pool.nodes", "Extra inputs"),
    ("learner", {"placement_strategy": "PACKED"}, "learner.placement_strategy", "'pack'"),
])
def test_bad_pool_values_fail_at_load_naming_the_field(section, values, field, words):
    with pytest.raises(ConfigError) as err:
        _cfg(**{section: values})
    assert field in str(err.value) and words in str(err.value)


def test_label_selectors_follow_rays_semantics():
    assert selector_matches("inference", "inference") and not selector_matches("inference", "training")
    assert not selector_matches("inference", None)
    assert selector_matches("!inference", "training") and selector_matches("!inference", None)
    assert selector_matches("in(a,b)", "b") and not selector_matches("in(a,b)", "c")
    assert selector_matches("!in(a, b)", "c") and not selector_matches("!in(a,b)", "a")


def test_pools_the_nodes_offer_pass():
    check_pools(_cfg(generator={"engine_pool": {"labels": {"pool": "inference"}}},
                     learner={"pool": {"resources": {"trainer_node": 0.5}}, "placement_strategy": "strict_pack"},
                     reward={"pool": {"labels": {"pool": "in(head,training)"}}},
                     trainer={"pool": {"labels": {"pool": "head"}}}), _nodes())


def test_a_pool_no_node_offers_fails_naming_the_field_and_the_cluster():
    cfg = _cfg(generator={"engine_pool": {"labels": {"pool": "gpu-inference"}}},
               reward={"pool": {"resources": {"reward_node": 0.1}}})
    with pytest.raises(PoolUnavailable) as err:
        check_pools(cfg, _nodes())
    text = str(err.value)
    assert "generator.engine_pool: no live node offers {CPU: 0.5} on labels {pool=gpu-inference}" in text
    assert "reward.pool: no live node offers {CPU: 0.1, reward_node: 0.1}" in text
    assert "learner.pool" not in text and "trainer.pool" not in text
    # The cluster's offer is in the message, without Ray's internal resources and labels.
    assert "node infer000 {CPU: 2} labels {pool=inference}" in text
    assert "node train000 {CPU: 2, trainer_node: 1} labels {pool=training}" in text
    assert "node:127" not in text and "ray.io" not in text and "memory" not in text
    assert isinstance(err.value, ConfigError)


def test_a_learner_group_must_fit_its_strategy():
    # Two ranks asking 0.5 trainer_node each fit the one node offering 1 (pack, strict_pack)...
    check_pools(_cfg(learner={"pool": {"resources": {"trainer_node": 0.5}}, "placement_strategy": "strict_pack"}), _nodes())
    # ...but not 0.75 each: the message says how many the qualifying nodes hold.
    with pytest.raises(PoolUnavailable, match=r"learner.pool: 2 x \{CPU: 0.5, trainer_node: 0.75\} needed; the nodes that qualify hold 1"):
        check_pools(_cfg(learner={"pool": {"resources": {"trainer_node": 0.75}}}), _nodes())
    # strict_spread needs one node per rank; strict_pack one node for all of them.
    with pytest.raises(PoolUnavailable, match="'strict_spread' needs 2 nodes offering .* 1 do"):
        check_pools(_cfg(learner={"pool": {"labels": {"pool": "training"}}, "placement_strategy": "strict_spread"}), _nodes())
    check_pools(_cfg(learner={"pool": {"labels": {"pool": "!head"}}, "placement_strategy": "strict_spread"}), _nodes())
    with pytest.raises(PoolUnavailable, match="'strict_pack' needs one node holding all 2 .* the most any node holds is 1"):
        check_pools(_cfg(learner={"num_cpus_per_rank": 1.5, "placement_strategy": "strict_pack"}), _nodes())


def test_engine_replicas_count_against_their_pool():
    # min_replicas 3 x 1 CPU on the one 2-CPU inference node: two fit, the third never would.
    cfg = _cfg(generator={"num_cpus": 1.0, "engine_pool": {"labels": {"pool": "inference"}},
                          "autoscaling": {"min_replicas": 3, "max_replicas": 3}})
    with pytest.raises(PoolUnavailable, match=r"generator.engine_pool: 3 x \{CPU: 1\} on labels \{pool=inference\} needed; .* hold 2"):
        check_pools(cfg, _nodes())


def test_gpus_count_where_a_pool_is_set():
    nodes = _nodes() + [NodeOffer("gpu00000dddd", {"CPU": 8.0, "GPU": 4.0}, {"pool": "inference"})]
    cfg = _cfg(generator={"num_gpus": 1.0, "engine_pool": {"labels": {"pool": "inference"}}})
    check_pools(cfg, nodes)
    with pytest.raises(PoolUnavailable, match=r"no live node offers \{CPU: 0.5, GPU: 1\}"):
        check_pools(cfg, _nodes())


def test_the_cluster_example_fits_the_cluster_it_describes():
    """deploy/rlhf-cluster.yaml loads, and its pools fit the nodes its comments start (a CPU head,
    two 8-GPU inference nodes, one 8-GPU training node), but not a cluster without a training node."""
    from pathlib import Path

    from asyncrl.config import load_config_file

    cfg = load_config_file(Path(__file__).resolve().parents[2] / "deploy" / "rlhf-cluster.yaml")
    head = NodeOffer("head0000", {"CPU": 16.0}, {"pool": "control"})
    infer = [NodeOffer(f"infer00{i}", {"CPU": 96.0, "GPU": 8.0}, {"pool": "inference"}) for i in range(2)]
    train = NodeOffer("train000", {"CPU": 96.0, "GPU": 8.0, "training_node": 1.0}, {"pool": "training"})
    check_pools(cfg, [head, *infer, train])
    with pytest.raises(PoolUnavailable, match=r"learner.pool: no live node offers \{CPU: 8, GPU: 1, training_node: 0.125\}"):
        check_pools(cfg, [head, *infer])


def test_a_reward_model_group_counts_against_its_own_pool():
    cfg = _cfg(reward={"kind": "model", "model": {"path": "x", "world_size": 2, "pool": {"labels": {"pool": "rm"}}}})
    with pytest.raises(PoolUnavailable, match=r"reward.model.pool: no live node offers \{CPU: 0.5\} on labels \{pool=rm\}"):
        check_pools(cfg, _nodes())
    check_pools(_cfg(reward={"kind": "model", "model": {"path": "x", "pool": {"labels": {"pool": "training"}}}}), _nodes())


def test_waits_name_the_pool_and_why_it_is_not_placed():
    """What `/train/status` shows while the start or a learner restart waits for Ray (`waiting_for`): the pool's
    field, what it asks, for how long, and why, against the live nodes; nothing once the wait ends."""
    from asyncrl.cluster import ENGINES_STARTING, Demand, engine_demand, waiting_for, waits_now
    from asyncrl.trainer.status_view import format_status

    nowhere = Demand("learner.pool", {"CPU": 0.5, "gpu_node": 1.0}, {}, count=2)
    engines = engine_demand(_cfg(generator={"engine_pool": {"labels": {"pool": "inference"}}}))
    assert engines.field == "generator.engine_pool" and engines.labels == {"pool": "inference"}
    assert waits_now(_nodes()) == []
    with waiting_for(nowhere):
        with waiting_for(engines, ENGINES_STARTING):
            waits = waits_now(_nodes())
            assert [w["pool"] for w in waits] == ["learner.pool", "generator.engine_pool"]  # oldest first
            assert waits[0]["asks"] == "2 x {CPU: 0.5, gpu_node: 1}" and waits[0]["for_s"] >= 0
            assert waits[0]["why"] == "no live node offers {CPU: 0.5, gpu_node: 1}"
            assert waits[1]["why"] == ENGINES_STARTING  # the inference node can hold it: starting or busy
            # the inference node lost: the engines' pool is one no live node offers any more
            lost = [n for n in _nodes() if n.labels.get("pool") != "inference"]
            assert waits_now(lost)[1]["why"].startswith("no live node offers {CPU: ") and "pool=inference" in waits_now(lost)[1]["why"]
            text = format_status({"state": "starting", "step": 0, "policy_version": 0, "waiting_for": waits})
            assert "waiting      learner.pool: 2 x {CPU: 0.5, gpu_node: 1} for 0m00s: no live node offers" in text
        assert [w["pool"] for w in waits_now(_nodes())] == ["learner.pool"]
    assert waits_now(_nodes()) == []
    with pytest.raises(RuntimeError), waiting_for(nowhere):
        raise RuntimeError("the wait failed")
    assert waits_now(_nodes()) == []  # a failed wait leaves nothing behind
