"""Rollouts that cannot finish: stragglers, poisoned prompts, a learner batch that cannot fill.

Pure logic over the real buffer service (in-process, its Ray methods called directly) and a
scripted engine: a hung generation attempt is cancelled at `trainer.rollout_timeout_s` (which is
how the engine is told to abort it) and retried; a prompt group that fails or times out on every
attempt is given up on once, counted as buffer/dropped_failed with its slots released, and its
prompt is never generated again; the learner waiting on a batch that cannot fill stops with an
error that says what the buffer and the rollouts hold."""

from __future__ import annotations

import asyncio
import types

import pytest

from asyncrl.buffer.actor import BufferService
from asyncrl.config import AlgorithmConfig, BufferConfig, RootConfig
from asyncrl.data.prompts import Prompt
from asyncrl.rewards import RewardOutcome
from asyncrl.trainer.loop import BatchTimeout, Trainer
from asyncrl.trainer.rollout import RolloutWorkers
from asyncrl.types import Completion, GenerationResult, SampleStatus
from tests.trainer._helpers import Remote

N = 2


class Tokenizer:
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return messages[0]["content"]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 50 for c in text]}


class Rewards:
    async def score(self, texts, answers, metadata, token_ids=None):
        return [RewardOutcome(1.0 if t == a else 0.0, SampleStatus.VALID, None) for t, a in zip(texts, answers)]


class Stream:
    def __init__(self, prompts) -> None:
        self.prompts, self.position = prompts, 0

    def next(self):
        index, self.position = self.position, self.position + 1
        return index, self.prompts[index % len(self.prompts)]


class Engine:
    """Answers each request by its prompt: `hang` never returns (until cancelled), `poison`
    raises, `slow-once` hangs on its first attempt only; others answer at once."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.cancelled = 0

    async def generate(self, request):
        key = next((k for k in ("hang", "poison", "slow-once") if k in _PROMPTS[tuple(request.prompt_ids)]), "ok")
        self.calls[key] = self.calls.get(key, 0) + 1
        if key == "poison":
            raise ValueError("the engine rejects this prompt")
        if key == "hang" or (key == "slow-once" and self.calls[key] == 1):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        completions = [Completion(index=i, token_ids=[1, 2], logprobs=[-0.1, -0.2], versions=[0, 0], finish_reason="stop",
                                  text=str(i)) for i in range(request.sampling.n)]
        return GenerationResult(request_id="r", prompt_ids=list(request.prompt_ids), completions=completions)


_PROMPTS: dict[tuple[int, ...], str] = {}


def _prompt(question: str) -> Prompt:
    _PROMPTS[tuple(Tokenizer()(question)["input_ids"])] = question
    return Prompt(prompt=question, answer="1")


def workers(engine: Engine, buffer: BufferService, prompts, **kw) -> RolloutWorkers:
    return RolloutWorkers(stream=Stream(prompts), tokenizer=Tokenizer(), generate=engine.generate, rewards=Rewards(),
                          buffer=Remote(buffer), algorithm=AlgorithmConfig(group_size=N), concurrency=1, seed=0,
                          backoff_s=0.0, **kw)


async def test_a_hung_generation_is_aborted_at_the_deadline_retried_then_given_up_on():
    buffer, engine = BufferService(BufferConfig(batch_size=2, max_staleness=0)), Engine()
    w = workers(engine, buffer, [_prompt("hang forever")], attempts=3, timeout_s=0.1)
    assert await buffer.acquire(N)
    await asyncio.wait_for(w.rollout_once(0, _prompt("hang forever")), 10)
    assert engine.calls["hang"] == 3 and engine.cancelled == 3  # every attempt was cancelled (= aborted in vLLM)
    c, m = w.counters, await buffer.metrics()
    assert (c.timeouts, c.retries, c.failed, c.finished) == (3, 2, 1, 0)
    assert (m["buffer/dropped_failed"], m["buffer/generated"], m["buffer/running"]) == (N, N, 0)
    assert "ran past 0.1 s" in c.errors[-1]


async def test_a_straggler_that_answers_on_its_retry_is_trained_on():
    buffer, engine = BufferService(BufferConfig(batch_size=2, max_staleness=0)), Engine()
    w = workers(engine, buffer, [], attempts=2, timeout_s=0.1)
    assert await buffer.acquire(N)
    await w.rollout_once(0, _prompt("slow-once"))
    c, m = w.counters, await buffer.metrics()
    assert (c.timeouts, c.failed, c.finished) == (1, 0, 1)
    assert (m["buffer/waiting"], m["buffer/dropped_failed"]) == (N, 0)


async def test_a_reward_scorer_that_raises_leaves_the_group_invalid_with_its_slots_given_back():
    class Raising:
        async def score(self, texts, answers, metadata, token_ids=None):
            raise RuntimeError("scorer broke")

    buffer, engine = BufferService(BufferConfig(batch_size=2, max_staleness=0)), Engine()
    w = workers(engine, buffer, [], attempts=1, timeout_s=5.0)
    w._rewards = Raising()
    assert await buffer.acquire(N)
    await asyncio.wait_for(w.rollout_once(0, _prompt("one")), 10)
    m = await buffer.metrics()
    assert (m["buffer/dropped_invalid"], m["buffer/running"], m["buffer/waiting"]) == (N, 0, 0)
    assert w.counters.finished == 1


async def test_a_poisoned_prompt_is_tried_k_times_then_dropped_and_the_run_moves_on():
    buffer, engine = BufferService(BufferConfig(batch_size=4, max_staleness=0)), Engine()
    prompts = [_prompt("poison pill"), _prompt("one"), _prompt("two"), _prompt("three")]
    w = workers(engine, buffer, prompts, attempts=3, timeout_s=5.0)
    stop = asyncio.Event()
    run = asyncio.create_task(w.run(stop))
    batch = await asyncio.wait_for(buffer.get_batch(timeout_s=None), 10)  # two good groups make a batch
    stop.set()
    await asyncio.wait_for(run, 10)
    assert engine.calls["poison"] == 3  # K attempts, then never again
    assert {s.prompt_index for s in batch.samples} == {1, 2}
    m = await buffer.metrics()
    assert m["buffer/dropped_failed"] == N and w.counters.failed == 1
    assert m["buffer/generated"] == sum(m[f"buffer/{k}"] for k in (
        "trained", "dropped_stale", "dropped_invalid", "dropped_filtered", "dropped_failed", "waiting"))


async def test_the_learner_stops_with_a_clear_error_when_no_batch_can_fill():
    cfg = RootConfig.model_validate({"buffer": {"batch_size": 4, "max_staleness": 0}, "algorithm": {"group_size": 2},
                                     "trainer": {"batch_timeout_s": 0.3}})
    buffer, engine = BufferService(cfg.buffer), Engine()
    w = workers(engine, buffer, [_prompt("hang forever")], attempts=1, timeout_s=60.0)
    parts = types.SimpleNamespace(start_version=0, buffer=Remote(buffer), rollouts=w)
    trainer = Trainer(cfg, parts)
    stop = asyncio.Event()
    rollouts = asyncio.create_task(w.run(stop))
    try:
        with pytest.raises(BatchTimeout) as err:
            await asyncio.wait_for(trainer._next_batch(rollouts), 10)
    finally:
        stop.set()
        rollouts.cancel()
        await asyncio.gather(rollouts, return_exceptions=True)
    text = str(err.value)
    assert "trainer.batch_timeout_s=0.3" in text and "no batch of 4 samples" in text
    assert "running=2" in text and "started=1" in text, text  # what the run is waiting on


def test_rollout_limits_are_validated():
    for bad in ({"rollout_timeout_s": 0}, {"rollout_attempts": 0}, {"batch_timeout_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RootConfig.model_validate({"trainer": bad})


async def test_a_stop_request_ends_the_wait_for_a_batch():
    cfg = RootConfig.model_validate({"buffer": {"batch_size": 4, "max_staleness": 0}, "algorithm": {"group_size": 2}})
    buffer = BufferService(cfg.buffer)
    trainer = Trainer(cfg, types.SimpleNamespace(start_version=0, buffer=Remote(buffer), rollouts=None))
    never = asyncio.create_task(asyncio.sleep(3600))  # rollouts that produce nothing
    waiting = asyncio.create_task(trainer._next_batch(never))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    trainer.request_stop()  # what the Serve replica's drain does
    assert await asyncio.wait_for(waiting, 5) is None
    never.cancel()


async def test_a_long_batch_wait_with_no_engine_replica_names_the_engine_pool(monkeypatch):
    """While the learner waits for a batch and no engine replica answers (the pool's last node lost), the
    wait is listed for /train/status (`waiting_for`: generator.engine_pool and why); once a replica answers
    again, or the wait ends, it is not."""
    import asyncrl.trainer.loop as loop
    from asyncrl.cluster import NodeOffer, waits_now

    monkeypatch.setattr(loop, "ENGINE_CHECK_S", 0.05)
    replicas: list[dict] = []

    class Broadcast:  # Serve's DeploymentHandle.broadcast(...): one result per running replica
        async def results_async(self, timeout_s, return_exceptions):
            return [dict(r) for r in replicas]

    handle = types.SimpleNamespace(broadcast=lambda method, *a, **kw: Broadcast())
    cfg = RootConfig.model_validate({"buffer": {"batch_size": 4, "max_staleness": 0}, "algorithm": {"group_size": 2},
                                     "generator": {"engine_pool": {"labels": {"pool": "inference"}}}})
    buffer = BufferService(cfg.buffer)
    trainer = Trainer(cfg, types.SimpleNamespace(start_version=0, buffer=Remote(buffer), rollouts=None, engine=handle))
    never = asyncio.create_task(asyncio.sleep(3600))
    waiting = asyncio.create_task(trainer._next_batch(never))
    head = [NodeOffer("head0000", {"CPU": 2.0}, {"pool": "head"})]
    try:
        await asyncio.sleep(1.3)  # the buffer's get_batch waits 1 s a call
        (w,) = waits_now(head)
        assert w["pool"] == "generator.engine_pool" and w["why"] == "no live node offers {CPU: 0.5} on labels {pool=inference}"
        assert waits_now(head + [NodeOffer("infer000", {"CPU": 2.0}, {"pool": "inference"})])[0]["why"] == loop.NO_ENGINE
        replicas.append({"replica_id": "r1", "version": 0})  # Serve started one again
        await asyncio.sleep(1.3)  # the buffer's get_batch waits 1 s a call
        assert waits_now(head) == []
        replicas.clear()
        await asyncio.sleep(1.3)  # the buffer's get_batch waits 1 s a call
        assert len(waits_now(head)) == 1
        trainer.request_stop()
        assert await asyncio.wait_for(waiting, 5) is None
        assert waits_now(head) == []  # the wait ended: nothing left listed
    finally:
        never.cancel()
        waiting.cancel()


async def test_an_engine_side_timeout_error_is_a_failed_attempt_not_a_deadline():
    from asyncrl.trainer.rollout import RolloutCounters, generate_with_retry

    async def engine_times_out(request):
        raise TimeoutError("the engine's own timeout")

    counters = RolloutCounters()
    with pytest.raises(TimeoutError, match="engine's own"):
        await generate_with_retry(engine_times_out, None, attempts=2, counters=counters, backoff_s=0.0, timeout_s=30.0)
    assert (counters.timeouts, counters.retries) == (0, 1)


async def test_a_replica_not_serving_is_waited_out_without_using_an_attempt(monkeypatch):
    """ReplicaNotReady (an engine that died, its replica being replaced) is retried with doubling waits and no attempt
    used up, so a prompt is not given up on while Serve still routes to the dead replica; past UNAVAILABLE_FOR_S it is
    an attempt like any failure. A request error is raised at once."""
    from asyncrl.generator.replica_types import ReplicaNotReady
    from asyncrl.generator.sampling import RequestError
    from asyncrl.trainer import rollout
    from asyncrl.trainer.rollout import RolloutCounters, generate_with_retry

    sleeps = []

    async def sleep(s):
        sleeps.append(s)

    monkeypatch.setattr(rollout.asyncio, "sleep", sleep)
    answers = [ReplicaNotReady("dead")] * 5 + [RuntimeError("replica died mid-request"), "result"]

    async def engine(request):
        answer = answers.pop(0)
        if isinstance(answer, RequestError):  # (Ray's error for it is also a RequestError)
            raise answer
        if isinstance(answer, BaseException):
            wrapped = RuntimeError("ray task error")
            wrapped.cause = answer
            raise wrapped
        return answer

    counters = RolloutCounters()
    assert await generate_with_retry(engine, None, attempts=2, counters=counters, backoff_s=0.5) == "result"
    assert (counters.unavailable, counters.retries) == (5, 1)
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 0.5]  # doubling to UNAVAILABLE_MAX_WAIT_S, then the attempt's backoff

    monkeypatch.setattr(rollout, "UNAVAILABLE_FOR_S", 0.0)  # no time left to wait: an attempt like any failure
    answers[:] = [ReplicaNotReady("dead")] * 2
    with pytest.raises(RuntimeError):
        await generate_with_retry(engine, None, attempts=2, counters=RolloutCounters(), backoff_s=0.0)
    answers[:] = [RequestError("n", "too big"), "never"]
    with pytest.raises(RequestError):
        await generate_with_retry(engine, None, attempts=3, counters=RolloutCounters(), backoff_s=0.0)
    assert answers == ["never"]

    monkeypatch.setattr(rollout, "UNAVAILABLE_FOR_S", 120.0)
    answers[:] = [ReplicaNotReady("dead"), "never"]  # stopping: Serve takes the engines down, nothing is waited out
    sleeps.clear()
    with pytest.raises(RuntimeError, match="ray task error"):
        await generate_with_retry(engine, None, attempts=3, counters=RolloutCounters(), backoff_s=0.5,
                                  stopping=lambda: True)
    assert answers == ["never"] and sleeps == []


def test_chat_prompts_are_sent_as_their_whole_chat(demo_model_path):
    """A dataset's chat prompt (system turn and all) reaches the engine rendered by the chat
    template; the same question without the chat is another prompt (the cache keys on both)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    w = RolloutWorkers(stream=Stream([]), tokenizer=tok, generate=Engine().generate, rewards=Rewards(),
                       buffer=Remote(BufferService(BufferConfig(batch_size=2, max_staleness=0))),
                       algorithm=AlgorithmConfig(group_size=N), concurrency=1, seed=0)
    chat = Prompt(prompt="What is 1 + 2?", answer="3", messages=(("system", "Be brief."), ("user", "What is 1 + 2?")))
    plain = Prompt(prompt="What is 1 + 2?", answer="3")
    chat_ids, plain_ids = w._request(0, chat).prompt_ids, w._request(1, plain).prompt_ids
    assert tok.decode(chat_ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
                                    "<|im_start|>assistant\n")
    assert tok.decode(plain_ids) == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_algorithm_ignore_eos_reaches_every_rollout_request(demo_model_path, ignore_eos):
    """algorithm.ignore_eos (fixed-length responses for benchmarks) is what the engine is asked for."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_path))
    w = RolloutWorkers(stream=Stream([]), tokenizer=tok, generate=Engine().generate, rewards=Rewards(),
                       buffer=Remote(BufferService(BufferConfig(batch_size=2, max_staleness=0))),
                       algorithm=AlgorithmConfig(group_size=N, ignore_eos=ignore_eos, max_new_tokens=7), concurrency=1, seed=0)
    sampling = w._request(0, Prompt(prompt="What is 1 + 2?", answer="3")).sampling
    assert (sampling.ignore_eos, sampling.max_tokens, sampling.n) == (ignore_eos, 7, N)


@pytest.mark.parametrize("field", ["max_tokens", "sampling.seed"])
async def test_a_request_the_engine_refuses_is_given_up_on_at_once_and_a_refused_setting_stops_the_run(field):
    """A RequestError (refused again on every replica) fails its rollout at its first attempt; the slots are counted
    as dropped_failed and the error kept for the run's report. Refused for its prompt (too long: max_tokens) the run
    goes on; refused for a sampling setting (every prompt would be) the rollouts stop with RolloutRefused, which the
    training loop raises at its next wait for a batch."""
    from asyncrl.generator.sampling import RequestError
    from asyncrl.trainer.rollout import RolloutRefused

    class Refusing(Engine):
        async def generate(self, request):
            self.calls["refused"] = self.calls.get("refused", 0) + 1
            raise RequestError(field, "not honoured by this engine")

    buffer, engine = BufferService(BufferConfig(batch_size=2, max_staleness=0)), Refusing()
    w = workers(engine, buffer, [], attempts=3, timeout_s=5.0)
    assert await buffer.acquire(N)
    once = w.rollout_once(0, _prompt("one"))
    if field == "max_tokens":
        await asyncio.wait_for(once, 10)
    else:
        with pytest.raises(RolloutRefused, match="refused this run's rollout requests: sampling.seed: not honoured"):
            await asyncio.wait_for(once, 10)
    c, m = w.counters, await buffer.metrics()
    assert engine.calls == {"refused": 1} and (c.retries, c.failed) == (0, 1)
    assert m["buffer/dropped_failed"] == N and m["buffer/running"] == 0 and "not honoured" in c.errors[-1]


def test_rollouts_are_seeded_only_where_the_engine_samples_by_a_seed():
    """SGLang reads a seed only with enable_deterministic_inference, and refuses a seeded request otherwise
    (on the H200s every rollout of the SGLang demo was refused so): the trainer leaves its requests unseeded
    there, and seeds them (the same seed per prompt position) everywhere else."""
    from asyncrl.config import GeneratorConfig
    from asyncrl.trainer.rollout import request_seed

    assert GeneratorConfig().honours_seeds
    assert not GeneratorConfig(engine="sglang", num_gpus=1).honours_seeds
    assert GeneratorConfig(engine="sglang", num_gpus=1, engine_kwargs={"enable_deterministic_inference": True}).honours_seeds
    for seeded in (True, False):
        w = workers(Engine(), BufferService(BufferConfig(batch_size=2, max_staleness=0)), [], seeded=seeded)
        seed = w._request(5, _prompt("one")).sampling.seed
        assert seed == (request_seed(0, 5) if seeded else None)


async def test_the_start_warm_up_generates_and_scores_but_nothing_reaches_the_buffer():
    buffer, engine = BufferService(BufferConfig(batch_size=2, max_staleness=0)), Engine()
    seen, scored = [], []

    async def generate(request):
        seen.append(request.sampling)
        return await engine.generate(request)

    class Counting(Rewards):
        async def score(self, texts, answers, metadata, token_ids=None):
            scored.append(len(texts))
            assert token_ids is not None and len(token_ids) == len(texts)
            return await super().score(texts, answers, metadata, token_ids)

    w = RolloutWorkers(stream=Stream([]), tokenizer=Tokenizer(), generate=generate, rewards=Counting(), buffer=Remote(buffer),
                       algorithm=AlgorithmConfig(group_size=N, max_new_tokens=256, temperature=0.7), concurrency=1, seed=0)
    m = await w.warm_up(_prompt("ok"), requests=3, score_at_least=8)
    # one request per replica, the rollouts' n and temperature, a short cut, no seed (a rollout's seed is its index's)
    assert [(s.n, s.temperature, s.max_tokens, s.seed, s.logprobs) for s in seen] == [(N, 0.7, 16, None, True)] * 3
    assert scored == [8] and m["completions"] == 8  # 6 completions repeated up to the 8 rule workers
    c, b = w.counters, await buffer.metrics()
    assert (c.started, c.finished, c.tokens) == (0, 0, 0)
    assert (b["buffer/generated"], b["buffer/waiting"]) == (0, 0)


def test_the_prompt_stream_peeks_without_moving():
    from asyncrl.trainer.data_stream import PromptStream

    prompts = [Prompt(prompt=str(i), answer=str(i)) for i in range(3)]
    s = PromptStream(prompts, seed=1)
    for _ in range(7):  # across epochs too
        p = s.peek()
        assert s.next()[1] is p
