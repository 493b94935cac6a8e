"""reward.kind http: the judge client against a real HTTP server whose replies the test controls
(valid scores, a scale, unparsable replies, 5xx then success, a 4xx, a slow judge past the timeout,
an unreachable judge). Every failure is INVALID_REWARD with its reason, never a 0."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from asyncrl.config import ConfigError, load_config
from asyncrl.rewards.judge import HttpJudge
from asyncrl.rewards.remote import reward_pool
from asyncrl.types import SampleStatus


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_server():
    """A judge at http://127.0.0.1:PORT/v1 whose reply is chosen by the prompt's first word."""
    import uvicorn

    app = FastAPI()
    seen: dict = {"prompts": [], "flaky": 0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "judge-1", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = body["messages"][0]["content"]
        seen["prompts"].append((body["model"], text, body["max_tokens"], body["temperature"]))
        kind = text.split()[0]
        if kind == "slow":
            await asyncio.sleep(2.0)
        if kind == "flaky":
            seen["flaky"] += 1
            if seen["flaky"] % 2:
                return JSONResponse({"error": "overloaded"}, status_code=503)
        if kind == "bad":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        reply = {"good": "I would say 7 out of 10, so 7", "words": "excellent answer", "flaky": "Score: 9",
                 "slow": "5", "solve": "12 + 34 is 46"}.get(kind, text)
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1", seen
    server.should_exit = True
    thread.join(timeout=10)


def _judge(url: str, **judge) -> HttpJudge:
    cfg = load_config({"reward": {"kind": "http", "judge": {"url": url, "prompt_template": "{completion} vs {answer} {metadata[id]}",
                                                            "timeout_s": 1.0, "retries": 1, **judge}}})
    scorer = reward_pool(cfg.reward)
    assert isinstance(scorer, HttpJudge)
    return scorer


async def test_scores_parse_scale_and_count(judge_server):
    url, seen = judge_server
    judge = _judge(url, scale=10.0)
    out = await judge.score(["good", "words", "12"], ["a", "b", "c"], [{"id": "x"}, {}, {}])
    assert out[0] == (0.7, SampleStatus.VALID, None)  # the last number of the reply, / scale
    assert out[1].status == SampleStatus.INVALID_REWARD and out[1].reward is None and "no score" in out[1].error
    assert out[2].reward == pytest.approx(1.2)  # the echoed prompt "12 vs c " scores 12 / 10
    assert ("judge-1", "good vs a x", 16, 0.0) in seen["prompts"]  # the model from /models, the filled template
    m = judge.metrics()
    assert (m["reward/judge_valid"], m["reward/judge_invalid"], m["reward/judge_unparsable"]) == (2.0, 1.0, 1.0)
    judge.close()


async def test_failures_are_invalid_with_the_reason_after_bounded_retries(judge_server):
    url, _ = judge_server
    judge = _judge(url, model="judge-1")
    t0 = time.monotonic()
    flaky, bad, slow = await judge.score(["flaky", "bad", "slow"], ["", "", ""])
    assert flaky.reward == 9.0  # a 503, then the retry scored
    assert bad.status == SampleStatus.INVALID_REWARD and "HTTP 404" in bad.error  # a 4xx is not retried
    assert slow.status == SampleStatus.INVALID_REWARD and "timed out after judge.timeout_s=1 s" in slow.error and "(2 attempts)" in slow.error
    assert time.monotonic() - t0 < 10  # bounded: 2 attempts of 1 s, never a hang
    m = judge.metrics()
    assert m["reward/judge_retries"] == 2.0 and m["reward/judge_timeouts"] == 2.0 and m["reward/judge_http_errors"] == 2.0
    unreachable = _judge(f"http://127.0.0.1:{_free_port()}/v1", model="judge-1", retries=0)
    (out,) = await unreachable.score(["good"], [""])
    assert out.status == SampleStatus.INVALID_REWARD and "unreachable" in out.error
    judge.close()
    unreachable.close()


async def test_agree_mode_rewards_a_completion_whose_answer_is_the_judges_own(judge_server):
    """judge.mode agree: the judge answers the problem (here: the question from the metadata) and a
    completion scores 1 where its last number equals the judge's, as numbers; a completion without a
    number scores 0 (a valid reward: it did not answer); a judge reply without one is invalid."""
    url, seen = judge_server
    judge = _judge(url, mode="agree", prompt_template="{metadata[question]}")
    meta = {"question": "solve 12 + 34"}
    out = await judge.score(["It is 46", "45", "46.0", "I do not know", "so 12 + 34 = 46"], [""] * 5, [meta] * 5)
    assert [o.reward for o in out] == [1.0, 0.0, 1.0, 0.0, 1.0] and all(o.status == SampleStatus.VALID for o in out)
    assert ("judge-1", "solve 12 + 34", 16, 0.0) in seen["prompts"]  # the judge is asked the question, not the completion
    (bad,) = await judge.score(["46"], [""], [{"question": "words only"}])
    assert bad.status == SampleStatus.INVALID_REWARD and "no score" in bad.error  # the judge gave no answer: not a 0
    m = judge.metrics()
    assert (m["reward/judge_valid"], m["reward/judge_agreed"], m["reward/judge_invalid"]) == (5.0, 3.0, 1.0)
    judge.close()
    with pytest.raises(ConfigError, match="mode"):
        load_config({"reward": {"kind": "http", "judge": {"url": "http://h/v1", "mode": "vote"}}})


def test_judge_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="needs judge.url"):
        load_config({"reward": {"kind": "http"}})
    with pytest.raises(ConfigError, match="score_pattern='\\(' is not a regular expression"):
        load_config({"reward": {"kind": "http", "judge": {"url": "http://h/v1", "score_pattern": "("}}})
    with pytest.raises(ConfigError, match="places rule workers only"):
        load_config({"reward": {"kind": "http", "judge": {"url": "http://h/v1"}, "pool": {"resources": {"reward_node": 1}}}})
