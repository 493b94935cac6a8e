"""Autoscaling 1 -> 2 -> 1 under HTTP load, where the second replica is a late joiner: it starts
after a weight update and must serve the current version (loaded from the WeightStore) from its
first token, and it takes the push plan the pushes use now from the store (so the next
engine-layout push does not find it without one). The app uses `routing: prefix_affinity`, so
this also checks that router in a real two-replica deployment: same prompt -> same replica,
different prompts spread."""

from __future__ import annotations

import asyncio
import itertools
import pickle
import threading

import httpx
import pytest
import ray
from generator_testlib import free_port, perturbed_weights, push_weights, wait_until

from asyncrl.app import run_generator
from asyncrl.config import load_config
from asyncrl.generator.control import EngineControl
from asyncrl.interfaces import EngineAPI
from asyncrl.weightsync.bucket import iter_buckets
from asyncrl.weightsync.fingerprint import tensor_fingerprint
from asyncrl.weightsync.service import WeightStore

pytestmark = pytest.mark.slow

APP = "gen_autoscale"
STORE, STORE_NS = "gen_test_store", "asyncrl_test"


def _replicas(control: EngineControl, count: int) -> dict[str, int] | None:
    versions = asyncio.run(control.versions())
    return versions if len(versions) == count else None


def _plan_for(control: EngineControl, replica_id: str, weights: dict):
    """The push plan `replica_id`'s engine forms for these tensors, as the service asks for it."""
    from tests.weightsync.fakes import plan_request

    acks = asyncio.run(control.call(EngineAPI.set_push_plan, plan_request(weights, 0.25)))
    return pickle.loads(acks[replica_id].plan)


def test_scale_up_with_late_joiner_on_current_version_and_back_down(ray_session, demo_model_path):
    from ray import serve

    store = ray.remote(WeightStore).options(name=STORE, namespace=STORE_NS, num_cpus=0).remote()
    port = free_port()
    cfg = load_config({
        "model": {"path": str(demo_model_path)},
        "generator": {
            "http_port": port, "num_cpus": 0.5, "routing": "prefix_affinity", "max_ongoing_requests": 8, "max_queued_requests": -1,
            "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                            "upscale_delay_s": 0, "downscale_delay_s": 2,
                            "metrics_interval_s": 0.5, "look_back_period_s": 2},
        },
    })
    run_generator(cfg, name=APP, weight_source=STORE, weight_source_namespace=STORE_NS)
    url = f"http://127.0.0.1:{port}"
    control = EngineControl(app_name=APP)
    stop = threading.Event()
    seen: list[dict] = []
    try:
        (first_replica,) = asyncio.run(control.versions())
        # Version 1 goes to the store first (late joiners read it), then to the live replica.
        w1 = perturbed_weights(demo_model_path, seed=11)
        ray.get(store.publish.remote(1, list(iter_buckets(w1.items(), 64.0)), tensor_fingerprint(w1)))
        push_weights(control, 1, w1)
        assert asyncio.run(control.versions()) == {first_replica: 1}
        # The push plan formed after the first replica started (the service puts it in the store
        # before handing it to the running replicas): a replica starting later takes it there.
        plan = _plan_for(control, first_replica, w1)
        ray.get(store.set_push_plan.remote(plan))
        asyncio.run(control.call(EngineAPI.set_push_plan, None))  # the first replica drops it: only the store holds it

        counter = itertools.count()

        def load() -> None:
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    i = next(counter)
                    r = client.post(f"{url}/generate", json={"prompt": f"{i % 50}+{i % 7}=", "max_tokens": 48, "ignore_eos": True})
                    if r.status_code == 200:
                        seen.append(r.json())

        workers = [threading.Thread(target=load, daemon=True) for _ in range(6)]
        for w in workers:
            w.start()
        versions = wait_until(lambda: _replicas(control, 2), 300, interval_s=2, what="a second replica")
        assert set(versions.values()) == {1}, versions  # the late joiner caught up before serving
        (new_replica,) = set(versions) - {first_replica}
        wait_until(lambda: any(r["replica_id"] == new_replica for r in seen), 60, what="a response from the new replica")
        from_new = [r for r in seen if r["replica_id"] == new_replica]
        assert all(r["versions"] == [1] for r in from_new)
        held = {rid: s["push_plan"] for rid, s in asyncio.run(control.call(EngineAPI.stats)).items()}
        assert held == {first_replica: None, new_replica: plan.plan_id}, held  # only the late joiner read the store
        # prefix affinity: one prompt keeps landing on one replica while both are up
        sticky = {httpx.post(f"{url}/generate", json={"prompt": "99+1=", "max_tokens": 2}, timeout=60).json()["replica_id"] for _ in range(5)}
        assert len(sticky) == 1, sticky
    finally:
        stop.set()
    for w in workers:
        w.join(timeout=150)
    remaining = wait_until(lambda: _replicas(control, 1), 180, interval_s=2, what="scale down to one replica")
    assert list(remaining.values()) == [1]
    serve.delete(APP)
    ray.kill(store)
    serve.shutdown()
