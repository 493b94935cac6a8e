"""The cheap behaviour-log-prob path on one real vLLM engine in this process.

A non-streaming request gets its sampled log-probs from the engine core as one array per
completion (generator/array_logprobs.py) and its text decoded once by the replica; a streaming
request takes vLLM's own per-step path (flat log-probs, the engine's incremental text). The
non-streaming batch runs once alone (the engine core takes the whole batch's column at once) and
once beside the streaming requests (it takes each marked request's slice). Both run
on the same engine with the same seeds, so the tokens are the same and every log-prob and every
text must be equal, and equal to what vLLM's `logprobs=0` returns by itself.

The same engine then shows the driver's prefix-cache salt: a request admitted after a commit (or during a
pause) never reuses KV cached under another version's salt, while one version's requests still share their
prefixes. (vLLM < 0.32 cannot drop KV blocks a request in flight holds when a push's pause resets the cache:
the salt is what keeps a later request off them.)
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow


def _requests() -> list[GenerationRequest]:
    sp = [
        SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=11),  # may stop at EOS
        SamplingParams(n=1, temperature=0.7, top_p=0.9, max_tokens=32, seed=5, ignore_eos=True),
        SamplingParams(n=2, temperature=1.3, top_k=20, max_tokens=16, seed=7, stop_token_ids=[20, 21, 22]),
        SamplingParams(n=1, temperature=0.0, max_tokens=20, ignore_eos=True),
    ]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [30, 31, 32, 33], [40, 41]]
    return [GenerationRequest(request_id=f"r{i}", prompt_ids=p, sampling=s) for i, (p, s) in enumerate(zip(prompts, sp))]


async def _cached_tokens(driver, rid: str, prompt: list[int]) -> int:
    """How many of `prompt`'s tokens the engine took from its prefix cache for request `rid`."""
    prepared = driver.prepare(SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), stream=False)
    last = None
    async for out in driver.outputs(rid, prompt, prepared, lambda: None):
        last = out
    return int(last.num_cached_tokens or 0)


async def _salted(driver) -> dict[str, int]:
    """Cached prompt tokens of one long prompt: cold, again at version 0, after a commit of version 1 (the
    driver's relabel; which weights is not what is checked here), again at 1, admitted during a pause, after it."""
    prompt = [1 + (i * 7) % 283 for i in range(240)]  # a full KV block at least (16 or 128 tokens)
    seen = {"cold": await _cached_tokens(driver, "a", prompt), "same_version": await _cached_tokens(driver, "b", prompt)}
    await driver.relabel(1)
    seen["after_commit"] = await _cached_tokens(driver, "c", prompt)
    seen["version_1_again"] = await _cached_tokens(driver, "d", prompt)
    await driver.hold()  # paused as for a push: a request admitted now runs after the resume
    during = asyncio.create_task(_cached_tokens(driver, "e", prompt))
    await asyncio.sleep(0.5)
    await driver.run()
    seen["admitted_in_pause"] = await during
    seen["after_resume"] = await _cached_tokens(driver, "f", prompt)
    return seen


@pytest.fixture(scope="module")
def out(demo_model_path) -> dict:
    return asyncio.run(_scenario(demo_model_path))


async def _scenario(model_path) -> dict:
    from vllm import SamplingParams as VllmSamplingParams

    from asyncrl.generator.engine import EngineReplica

    # vLLM's prepacked oneDNN kernels compute a row the same whatever else is in the batch, so values
    # from different batches (a request alone, the same request beside others) compare exactly;
    # the unpacked F.linear weights weight pushes copy into (the default) round by batch shape.
    replica = EngineReplica(ModelConfig(path=str(model_path), max_model_len=256, dtype="float32"),
                            GeneratorConfig(cpu_unpacked_weights=False))
    await replica.start()
    try:
        reqs = _requests()
        # The whole batch at once, so marked and unmarked sequences share engine steps.
        final = await asyncio.gather(*(replica.generate(r) for r in reqs))

        async def streamed(r: GenerationRequest):
            parts: dict[int, dict] = {}
            async for deltas in replica.generate_stream(r):
                for d in deltas:
                    p = parts.setdefault(d.index, {"token_ids": [], "logprobs": [], "text": "", "finish_reason": None})
                    p["token_ids"] += d.token_ids
                    p["logprobs"] += d.logprobs
                    p["text"] += d.text
                    p["finish_reason"] = d.finish_reason
            return parts

        # Marked and vLLM-path requests in the same steps: the engine core slices per request then.
        both = await asyncio.gather(*(replica.generate(r) for r in reqs), *(streamed(r) for r in reqs))
        mixed, stream = both[: len(reqs)], both[len(reqs):]

        async def vllm_own(r: GenerationRequest):  # vLLM's default containers, no flags of ours
            s = r.sampling
            params = VllmSamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=max(s.top_k, 0),
                                        max_tokens=s.max_tokens, seed=s.seed, logprobs=0, ignore_eos=s.ignore_eos,
                                        stop_token_ids=s.stop_token_ids or None)
            got = {}  # cumulative outputs: a sequence's last one holds all of it
            async for out in replica.engine.llm.generate({"prompt_token_ids": r.prompt_ids}, params, f"own-{r.request_id}"):
                for c in out.outputs:
                    got[c.index] = (list(c.token_ids), [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)], c.text)
            return got

        own = await asyncio.gather(*(vllm_own(r) for r in reqs))
        return {"array": replica.engine._read_array is not None, "decoded_here": replica.engine._tokenizer is not None,
                "final": final, "mixed": mixed, "stream": stream, "own": own, "salt": await _salted(replica.engine)}
    finally:
        replica.shutdown()


def test_array_logprobs_and_replica_text_equal_vllms_own(out):
    assert out["array"] and out["decoded_here"], "the adapter and the replica's decoding must be on by default"
    stops = 0
    for result, mixed, streamed, own in zip(out["final"], out["mixed"], out["stream"], out["own"]):
        assert [c.logprobs for c in mixed.completions] == [c.logprobs for c in result.completions]
        assert [c.token_ids for c in mixed.completions] == [c.token_ids for c in result.completions]
        assert sorted(c.index for c in result.completions) == sorted(streamed) == sorted(own)
        for c in result.completions:
            s, (own_ids, own_lps, own_text) = streamed[c.index], own[c.index]
            assert c.token_ids == s["token_ids"] == own_ids
            assert len(c.logprobs) == len(c.token_ids) > 0
            # Exact: the same float32 values the workers computed, however they travelled.
            assert c.logprobs == s["logprobs"] == own_lps
            assert c.text == s["text"] == own_text
            assert c.finish_reason == s["finish_reason"]
            stops += c.finish_reason == "stop"
    # The stop-token rule of the replica's text (the stopping token is left out) was exercised.
    assert stops > 0


def test_no_request_reuses_kv_cached_under_another_version(out):
    seen = out["salt"]
    assert seen["cold"] == 0 and seen["same_version"] > 0, seen  # prefix caching is on: the test can see a hit
    assert seen["after_commit"] == 0, seen  # the old version's KV is not reused after the commit
    assert seen["version_1_again"] == seen["same_version"], seen  # ... while one version's requests share
    assert seen["admitted_in_pause"] == 0, seen  # admitted during a pause: a salt of its own
    assert seen["after_resume"] == seen["same_version"], seen  # resumed on version 1: its KV again

