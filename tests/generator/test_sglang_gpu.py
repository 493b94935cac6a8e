"""The generator with SGLang engines, as deployed: a real SGLang 0.5.15 replica (CUDA only) behind the real Ray
Serve gateway, over real HTTP, the same checks as vLLM's replica (test_serve_api.py): the OpenAI client
(completions, chat n, streaming, log-probs, versions), greedy tokens after a push equal to transformers' argmax
of the pushed weights, a request in flight across a commit labelled with both versions in the right places, a
corrupted bucket or a wrong fingerprint leaving the previous version serving; and the hybrid step: sleep ->
push -> wake.

SGLang's packages live apart from vLLM's on the GPU host (benchmarks/sglang/wheels.sh): the replica's process
gets `ASYNCRL_SGLANG_PATH` (default /tmp/site-sglang) before its PYTHONPATH (`generator.engine_pythonpath`).
The engine runs with the slim wheel set's backends (triton attention, pytorch sampling), in float16 (SGLang has
no float32 RMSNorm): its greedy tokens are checked against transformers' float32 logits teacher-forced, each within
a rounding gap of the best (generator_testlib.assert_half_precision_greedy).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
from generator_testlib import (
    ADMIN_TOKEN,
    assert_half_precision_greedy,
    free_port,
    generate_across_a_commit,
    perturbed_weights,
    push_by_steps,
    push_weights,
    wait_until,
)

from asyncrl.generator.control import ReplicaControlError
from asyncrl.interfaces import EngineAPI
from asyncrl.weightsync.fingerprint import tensor_fingerprint

pytestmark = pytest.mark.gpu

APP = "gen_sglang"
SGLANG_PATH = os.environ.get("ASYNCRL_SGLANG_PATH", "/tmp/site-sglang")
SLIM = {"attention_backend": "triton", "sampling_backend": "pytorch", "mem_fraction_static": 0.3, "dtype": "float16"}


@pytest.fixture(scope="module")
def gen(ray_session, demo_model_path):
    import torch

    if not torch.cuda.is_available() or not (Path(SGLANG_PATH) / "sglang").is_dir():
        pytest.skip(f"needs CUDA and SGLang installed in {SGLANG_PATH}")
    from ray import serve

    from asyncrl.app import run_generator
    from asyncrl.config import load_config
    from asyncrl.generator.control import EngineControl

    port = free_port()
    rest = os.environ.get("PYTHONPATH", "")
    cfg = load_config({
        "model": {"path": str(demo_model_path), "max_model_len": 256},
        "generator": {"engine": "sglang", "num_gpus": 1, "num_cpus": 1, "admin_token": ADMIN_TOKEN, "http_port": port,
                      "max_n": 8, "engine_kwargs": {**SLIM, "enable_memory_saver": True},
                      "engine_pythonpath": SGLANG_PATH + (f":{rest}" if rest else "")},
    })
    run_generator(cfg, name=APP, weight_source=None)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 600, what="gateway health")
    from transformers import AutoTokenizer

    from asyncrl.data import render_chat_prompt

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    prompt_ids = tok.encode(render_chat_prompt(tok, "What is 12+34?"), add_special_tokens=False)
    yield {"url": url, "control": EngineControl(app_name=APP), "prompt_ids": prompt_ids}
    serve.delete(APP)
    serve.shutdown()


def _post(gen, path, body):
    return httpx.post(gen["url"] + path, json=body, timeout=120)


def _versions(gen) -> list[int]:
    return list(asyncio.run(gen["control"].versions()).values())


def test_openai_client_completions_chat_n_and_streaming(gen):
    import openai  # (here, not in the fixture: on the GPU host its transport needs truststore, carried in .whl)

    client = openai.OpenAI(base_url=f"{gen['url']}/v1", api_key="unused", max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    out = client.completions.create(model=model, prompt="What is 2+3?", max_tokens=8, temperature=0, logprobs=1)
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert 0 < len(ids) <= 8 and choice.model_extra["versions"] == [0] * len(ids)
    assert len(choice.logprobs.token_logprobs) == len(ids) and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 12+34?"}],
                                          n=3, max_tokens=16, temperature=1.0)
    assert len(chat.choices) == 3 and {c.index for c in chat.choices} == {0, 1, 2}
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="What is 2+3?", max_tokens=8, temperature=0, stream=True))
    assert streamed == choice.text


def test_generate_returns_tokens_logprobs_and_versions(gen):
    r = _post(gen, "/generate", {"prompt_ids": gen["prompt_ids"], "n": 2, "max_tokens": 12, "temperature": 1.0,
                                 "logprobs": True})
    assert r.status_code == 200 and r.headers["x-asyncrl-weight-version"] == "0"
    for c in r.json()["completions"]:
        assert len(c["token_ids"]) == len(c["logprobs"]) == len(c["versions"]) > 0 and set(c["versions"]) == {0}


def test_weight_push_gives_transformers_greedy_tokens_of_the_pushed_weights(gen, demo_model_path):
    ids = gen["prompt_ids"]
    body = {"prompt_ids": ids, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    before = _post(gen, "/generate", body).json()["completions"][0]["token_ids"]
    assert_half_precision_greedy(demo_model_path, None, ids, before)
    w1 = perturbed_weights(demo_model_path, seed=1)
    result = push_weights(gen["control"], 1, w1, bucket_mb=0.25)  # HF tensors, several buckets
    assert result.metrics["weightsync/num_buckets"] > 1 and _versions(gen) == [1]
    r = _post(gen, "/generate", body)
    after = r.json()["completions"][0]
    assert r.headers["x-asyncrl-weight-version"] == "1" and set(after["versions"]) == {1}
    assert len(after["token_ids"]) == 8 and after["token_ids"] != before
    assert_half_precision_greedy(demo_model_path, w1, ids, after["token_ids"])  # (and no prefix KV of version 0 reused)


def test_request_in_flight_across_a_commit_shows_both_versions_in_order(gen, demo_model_path):
    body = {"prompt_ids": gen["prompt_ids"], "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    r = generate_across_a_commit(lambda b: _post(gen, "/generate", b), gen["control"], body,
                                 perturbed_weights(demo_model_path, seed=2), 2, interval_s=0.02)
    c = r.json()["completions"][0]
    assert len(c["token_ids"]) == len(c["versions"]) == 200 and r.headers["x-asyncrl-weight-version"] == "1,2"
    first_new = c["versions"].index(2)
    assert first_new >= 5 and c["versions"] == [1] * first_new + [2] * (200 - first_new)
    # the old-version tokens are version 1's greedy tokens: none was made by the new weights
    assert_half_precision_greedy(demo_model_path, perturbed_weights(demo_model_path, seed=1), gen["prompt_ids"],
                                 c["token_ids"][:first_new])


def test_a_corrupted_bucket_or_a_wrong_fingerprint_keeps_the_previous_version(gen, demo_model_path):
    control = gen["control"]
    body = {"prompt_ids": gen["prompt_ids"], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    before = _post(gen, "/generate", body).json()["completions"][0]["token_ids"]
    w3 = perturbed_weights(demo_model_path, seed=3)
    corrupted = dict(w3)
    name = sorted(corrupted)[0]
    corrupted[name] = corrupted[name].clone()
    corrupted[name].view(-1)[0] += 1.0
    for tensors, fp in ((corrupted, tensor_fingerprint(w3)), (w3, "0" * 64)):
        with pytest.raises(ReplicaControlError) as err:
            push_by_steps(control, 3, tensors, fp)
        assert "fingerprint mismatch" in next(iter(err.value.failures.values()))
        assert _versions(gen) == [2]
        r = _post(gen, "/generate", body)
        assert r.headers["x-asyncrl-weight-version"] == "2" and r.json()["completions"][0]["token_ids"] == before
    push_weights(control, 3, w3)
    assert _versions(gen) == [3]


def test_sleep_push_wake_in_the_hybrid_order(gen, demo_model_path):
    control = gen["control"]
    (stats,) = asyncio.run(control.stats()).values()
    assert stats["sleep_unsupported"] is None
    asyncio.run(control.call(EngineAPI.sleep, 2))  # SGLang without a CPU backup of the weights: level 2
    asyncio.run(control.call(EngineAPI.wake_up, ["weights"]))
    w4 = perturbed_weights(demo_model_path, seed=4)
    push_weights(control, 4, w4)  # every weight refilled: level 2 discarded them
    asyncio.run(control.call(EngineAPI.wake_up, ["kv_cache"]))
    body = {"prompt_ids": gen["prompt_ids"], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    r = _post(gen, "/generate", body)
    assert r.headers["x-asyncrl-weight-version"] == "4"
    assert_half_precision_greedy(demo_model_path, w4, gen["prompt_ids"], r.json()["completions"][0]["token_ids"])
