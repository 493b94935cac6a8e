"""Several Ray nodes on one machine: resource pools place each component on its nodes, weights cross
nodes with the transport `auto` picks there, and a lost node is survived.

The module starts its own Ray cluster (`ray.cluster_utils.Cluster`: a head and worker nodes,
each its own raylet and object store, with distinct labels and custom resources) in place of the
session's one-node runtime, which it starts again afterwards. Nodes:
  control   (head, label pool=control): Serve's controller and proxy, the trainer, the gateway, reward workers
  inference (label pool=inference): the engine replicas
  training  (label pool=training, resource trainer_node: 1): the learner's two ranks (TP=2, strict_pack)
One run checks the placement, the transport and the HTTP API, then (with a spare node of each pool added
first) kills the node hosting the engine replica, and once it serves again the node hosting the learner ranks.
"""

from __future__ import annotations

import time

import pytest

from asyncrl.config import load_config
from tests.conftest import RAY_RUNTIME_ENV, init_local_ray
from tests.e2e.test_training_loop import _lines, _run, _steps

pytestmark = pytest.mark.slow

NODE_MEMORY = 256 << 20  # each node's object store (all on this host's /dev/shm)
TRAINER_NODE = "trainer_node"


def _pools(total: int, **overrides: dict) -> dict:
    """Config sections placing every component on its node (see the module docstring)."""
    sections = {
        "generator": {"engine_pool": {"labels": {"pool": "inference"}}, "gateway_pool": {"labels": {"pool": "control"}}},
        "learner": {"world_size": 2, "strategy_config": {"tensor_model_parallel_size": 2}, "num_cpus_per_rank": 0.5,
                    "pool": {"resources": {TRAINER_NODE: 0.5}}, "placement_strategy": "strict_pack"},
        "reward": {"pool": {"labels": {"pool": "control"}}},
        "trainer": {"pool": {"labels": {"pool": "control"}}, "total_steps": total, "eval_interval_steps": 0},
        "weightsync": {"transport": "auto"},
        "checkpoint": {"interval_steps": 0},
    }
    for name, values in overrides.items():
        sections.setdefault(name, {}).update(values)
    return sections


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    had_session = ray.is_initialized()
    if had_session:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "labels": {"pool": "control"}, "object_store_memory": NODE_MEMORY, "include_dashboard": False})
    nodes = {"control": c.head_node}
    nodes["inference"] = c.add_node(num_cpus=2, labels={"pool": "inference"}, object_store_memory=NODE_MEMORY)
    nodes["training"] = c.add_node(num_cpus=2, resources={TRAINER_NODE: 1}, labels={"pool": "training"}, object_store_memory=NODE_MEMORY)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, runtime_env=RAY_RUNTIME_ENV)
    try:
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        if had_session:
            init_local_ray()


def _node_of(nodes: dict) -> dict[str, str]:
    return {n.node_id: name for name, n in nodes.items()}


def _placed(names: dict[str, str]) -> dict[str, list[str]]:
    """The node name of every live actor of ours, by class: {'LearnerRank': ['training', ...], ...}."""
    from ray._private.state import actors

    out: dict[str, list[str]] = {}
    for a in actors().values():
        if a["State"] != "ALIVE":
            continue
        cls = a["ActorClassName"]
        for key in ("GeneratorEngine", "GeneratorGateway", "Trainer", "LearnerRank", "RewardWorkersService", "BufferService",
                    "WeightStore"):
            if cls == key or cls.endswith(f":{key}"):
                out.setdefault(key, []).append(names.get(a["Address"]["NodeID"], a["Address"]["NodeID"][:8]))
    return {k: sorted(v) for k, v in out.items()}


def _accounted(b: dict) -> bool:
    return b["buffer/generated"] == (b["buffer/trained"] + b["buffer/dropped_stale"] + b["buffer/dropped_invalid"]
                                     + b["buffer/dropped_filtered"] + b["buffer/dropped_failed"] + b["buffer/waiting"])


def test_the_live_cluster_is_read_and_a_pool_it_lacks_fails_fast(cluster, demo_model_path):
    from asyncrl.app import build_app
    from asyncrl.cluster import PoolUnavailable, live_nodes

    _, nodes = cluster
    offers = {o.node_id: o for o in live_nodes()}
    assert set(offers) == {n.node_id for n in nodes.values()}
    assert offers[nodes["training"].node_id].resources[TRAINER_NODE] == 1.0
    assert offers[nodes["inference"].node_id].labels["pool"] == "inference"
    raw = _pools(2, generator={"engine_pool": {"labels": {"pool": "gpu-inference"}}},
                 learner={"pool": {"resources": {TRAINER_NODE: 0.75}}, "placement_strategy": "strict_pack"})
    raw["model"] = {"path": str(demo_model_path)}
    t = time.monotonic()
    with pytest.raises(PoolUnavailable) as err:
        build_app(load_config(raw, source="test"))
    assert time.monotonic() - t < 5
    text = str(err.value)
    assert "generator.engine_pool: no live node offers {CPU: 0.5} on labels {pool=gpu-inference}" in text
    assert "learner.pool: placement_strategy 'strict_pack' needs one node holding all 2" in text
    assert "labels {pool=inference}" in text and f"{TRAINER_NODE}: 1" in text  # the cluster's offer


def test_reward_workers_run_on_their_pool(cluster):
    from asyncrl.config import RewardConfig
    from asyncrl.rewards.remote import RemoteRewardPool
    from asyncrl.types import SampleStatus

    _, nodes = cluster
    import asyncio

    async def go():
        pool = RemoteRewardPool(RewardConfig(pool={"labels": {"pool": "training"}}))
        try:
            node = await pool.node_id()
            outcomes = await pool.score(["46", "45", "x"], ["46", "46", "46"], [{}, {}, {}])
        finally:
            pool.close()
        return node, outcomes

    node, outcomes = asyncio.run(go())
    assert node == nodes["training"].node_id
    assert [o.reward for o in outcomes[:2]] == [1.0, 0.0]
    assert outcomes[2].status in (SampleStatus.VALID, SampleStatus.INVALID_REWARD)


def test_reward_workers_start_again_on_their_pool_when_their_node_is_lost(cluster):
    """reward.pool on two nodes of its own: the node hosting the reward actor is lost (its raylet and every
    process killed); Ray starts the actor on the pool's other node (reward.max_restarts) and the next call is
    scored there. (Without restarts, or past them, the call fails: tests/unit/test_reward_remote.py.)"""
    import asyncio

    import ray

    from asyncrl.config import RewardConfig
    from asyncrl.rewards.remote import RemoteRewardPool

    c, _ = cluster
    added = [c.add_node(num_cpus=1, labels={"pool": "reward"}, object_store_memory=NODE_MEMORY) for _ in range(2)]
    c.wait_for_nodes()

    async def lose_its_node(max_restarts: int):
        pool = RemoteRewardPool(RewardConfig(pool={"labels": {"pool": "reward"}}, num_cpus=0.5, max_restarts=max_restarts))
        try:
            first = await pool.node_id()
            assert [o.reward for o in await pool.score(["46", "45"], ["46", "46"], [{}, {}])] == [1.0, 0.0]
            lost = next(n for n in added if n.node_id == first)
            c.remove_node(lost, allow_graceful=False)
            added.remove(lost)
            # until the GCS marks the node dead, the actor's orphaned worker may still answer calls directly
            deadline = time.monotonic() + 90
            while any(n["NodeID"] == first and n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
            after = await asyncio.wait_for(pool.score(["7"], ["7"], [{}]), 180)
            return first, await pool.node_id(), [o.reward for o in after], pool.metrics()
        finally:
            pool.close()

    try:
        first, second, after, metrics = asyncio.run(lose_its_node(max_restarts=3))
        assert second is not None and second != first and second in [n.node_id for n in added]
        assert after == [1.0] and metrics["reward/worker_retries"] in (0.0, 1.0)  # 1 when the call met the dead actor
    finally:
        for n in added:
            c.remove_node(n)


def _add_spare(c, nodes: dict, pool: str, **node_args) -> dict:
    """A second node of `pool`; returns the node map with it as `<pool>-spare`."""
    spare = c.add_node(num_cpus=2, labels={"pool": pool}, object_store_memory=NODE_MEMORY, **node_args)
    c.wait_for_nodes()
    return {**nodes, f"{pool}-spare": spare}


def _kill_the_node_of(actor_class: str, after_step: int, c, nodes: dict, fault: dict):
    """A `during` hook: once training passed `after_step`, kill the raylet and every process of the
    node hosting `actor_class`; then note where that actor runs again (`nodes` may grow meanwhile)."""

    def hook(seen: dict) -> None:
        placed = _placed(_node_of(nodes))
        if fault:
            # The lost node's actors stay ALIVE in the GCS until it notices the node is gone.
            # Only once all of them run again: a group's actors start one by one, and a poll
            # between two starts saw one learner rank of two.
            elsewhere = [n for n in placed.get(actor_class, []) if n != fault["node"]]
            if "again" not in fault and len(elsewhere) >= len(fault["placed"][actor_class]):
                fault.update(again=elsewhere, again_step=seen["statuses"][-1]["step"] if seen["statuses"] else None)
            return
        if not seen["statuses"] or seen["statuses"][-1]["step"] < after_step or actor_class not in placed:
            return
        victim = placed[actor_class][0]
        fault.update(node=victim, placed=placed, at=time.monotonic(), step=seen["statuses"][-1]["step"])
        c.remove_node(nodes[victim], allow_graceful=False)

    return hook


def test_three_nodes_train_on_their_pools_and_survive_losing_the_engines_node_then_the_learners(cluster, demo_model_path,
                                                                                                 tmp_path):
    """`serve run`'s start of the app on three nodes: engines on `inference`, the learner (TP=2) on
    `training`, reward workers, trainer, gateway, buffer and weightsync's store and registry on
    `control`; weights cross nodes through the object store (`auto` on several CPU nodes), versions
    rise over HTTP. Then (a spare node of each pool added first) the node hosting the engine replica
    dies mid-training (raylet and every process killed): Serve starts the replica again on the pool's
    other node, it loads the live version, the rollouts in flight are retried or counted. Once it
    serves, the node hosting both learner ranks dies, with trainer.max_restarts 1: the step fails, the
    learner group starts again on the training pool's other node from the last checkpoint, the step is
    redone. Training goes on to its end with every version published once, in order, and every sample
    accounted for. (One run for both losses: the app's start on three nodes is most of each.)"""
    c, nodes = cluster
    # 20 steps: the spare nodes started at step 1 take seconds while training goes on (0.6 s a step on 2 cores),
    # so the engines' node dies a few steps after step 2, the learner's two steps after the engine serves again
    total, engines_lost, learner_lost, placed, later = 20, {}, {}, {}, {}
    kill_engines = _kill_the_node_of("GeneratorEngine", 2, c, nodes, engines_lost)

    def during(seen: dict) -> None:
        if not placed and seen["statuses"] and seen["statuses"][-1]["step"] >= 1:
            placed.update(_placed(_node_of(nodes)))
            nodes.update(_add_spare(c, nodes, "inference"))  # after the placement: the engine sits on `inference`
            nodes.update(_add_spare(c, nodes, "training", resources={TRAINER_NODE: 1}))
        kill_engines(seen)
        if "again" in engines_lost and "kill" not in later:
            later["kill"] = _kill_the_node_of("LearnerRank", seen["statuses"][-1]["step"] + 2, c, nodes, learner_lost)
        if "kill" in later:
            later["kill"](seen)

    seen = _run(cluster, demo_model_path, tmp_path, during=during,
                **_pools(total, trainer={"rollout_timeout_s": 120, "max_restarts": 1}, checkpoint={"interval_steps": 2},
                         weightsync={"recovery_s": 600, "timeout_s": 60}))
    final = seen["statuses"][-1]
    assert engines_lost and learner_lost, ("the run ended before both faults could be injected", engines_lost, learner_lost)
    for fault in (engines_lost, learner_lost):  # later tests: the surviving nodes, under the pools' names
        lost = fault["node"]
        nodes.pop(lost)
        if f"{lost}-spare" in nodes:
            nodes[lost] = nodes.pop(f"{lost}-spare")
    # weightsync's store holds the live version: pinned to the trainer's node, so that
    # losing an engine or learner node cannot take them along.
    assert placed == {"GeneratorEngine": ["inference"], "GeneratorGateway": ["control"], "Trainer": ["control"],
                      "LearnerRank": ["training", "training"], "RewardWorkersService": ["control"],
                      "BufferService": ["control"], "WeightStore": ["control"]}, placed
    assert engines_lost["node"] == "inference" and engines_lost.get("again") == ["inference-spare"], engines_lost
    assert learner_lost["node"] == "training" and learner_lost["placed"]["LearnerRank"] == ["training", "training"]
    assert learner_lost.get("again") == ["training-spare", "training-spare"], learner_lost
    assert final["state"] == "finished", (final, engines_lost, learner_lost)
    assert final["step"] == final["policy_version"] == total and final["learner_restarts"] == 1
    assert total - learner_lost["step"] >= 3 and learner_lost["step"] > engines_lost["step"]
    assert _accounted(final["buffer"]) and final["buffer"]["buffer/trained"] >= total * 16
    assert any(code == 200 and engines_lost["at"] < t < learner_lost["at"] for t, code in seen["answers"])
    assert any(code == 200 and t > learner_lost["at"] for t, code in seen["answers"])  # the engines kept serving
    assert seen["openai_status"] == 200 and seen["openai_header"] == str(total)
    header_versions = [v for v, _ in seen["versions"]]
    assert header_versions == sorted(header_versions) and header_versions[-1] == total
    metrics = _steps(_lines(tmp_path / "metrics.jsonl"))
    assert [m["weightsync/version"] for m in metrics] == list(range(1, total + 1))
    assert metrics[-1]["trainer/learner_restarts"] == 1.0
    assert all(m["weightsync/transport/object_store/bytes"] == m["weightsync/bytes"] > 0 for m in metrics)
    assert seen["left_after_shutdown"] == [], seen["left_after_shutdown"]
