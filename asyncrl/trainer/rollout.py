"""Rollout workers: prompts -> staleness slot -> engine group -> rewards -> buffer.

Owns: the per-prompt rollout protocol (acquire n slots, generate a GRPO group through the Serve
handle with retries across replicas, score every completion in the reward pool, push the whole
group) and the bounded concurrency of those rollouts.
Must never: drop a sample without the buffer counting it (a failed completion is pushed as
ABORTED, a bad reward as INVALID_REWARD; a rollout whose generation failed or timed out on every
attempt is given up on: `buffer.abandon(n)` counts its samples as dropped_failed, and the prompt
is not retried again), wait forever on one generation (each attempt has a deadline), or consume
a prompt before its slots are granted (that keeps the prompt stream
aligned with admission, which exact resume relies on).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec

from asyncrl.config import AlgorithmConfig
from asyncrl.data.prompts import Prompt, render_prompt
from asyncrl.generator.replica_types import replica_unavailable
from asyncrl.generator.sampling import RequestError
from asyncrl.rewards.pool import RewardOutcome
from asyncrl.trainer.data_stream import PromptStream
from asyncrl.types import GenerationRequest, GenerationResult, Sample, SampleStatus, SamplingParams

log = logging.getLogger(__name__)

GenerateFn = Callable[[GenerationRequest], Awaitable[GenerationResult]]

# A request refused for one of these fields is its prompt's (too long, bad tokens): that prompt is dropped and the
# run goes on. Refused for any other (sampling parameters: the run's settings), every prompt would be: the run stops.
PROMPT_FIELDS = ("prompt_ids", "max_tokens")
# The start's warm-up generation (`RolloutWorkers.warm_up`): enough tokens to run both the prefill and the decode
# path with the run's sampling settings, few enough to cost little at start.
WARM_UP_TOKENS = 16


class RolloutRefused(RuntimeError):
    """The engine refuses the run's rollout requests whatever the prompt: the training loop fails at once,
    saying so (instead of at trainer.batch_timeout_s, with every prompt dropped meanwhile)."""


def request_seed(run_seed: int, prompt_index: int) -> int:
    """Per-request sampling seed: the same prompt position samples the same way after a resume."""
    return zlib.crc32(f"{run_seed}:{prompt_index}".encode()) & 0x7FFFFFFF


@dataclass
class RolloutCounters:
    started: int = 0
    finished: int = 0
    failed: int = 0  # generation failed after all attempts: given up on (buffer/dropped_failed)
    retries: int = 0
    timeouts: int = 0  # attempts that ran past the rollout deadline (aborted in the engine)
    unavailable: int = 0  # calls that met a replica not serving (waited out, not counted as attempts)
    tokens: int = 0
    staleness_sum: float = 0.0  # version spread inside completions (first token vs last token)
    version_switches: int = 0  # completions whose tokens span more than one weight version
    errors: list[str] = field(default_factory=list)
    extra: dict[str, int] = field(default_factory=dict)  # a rollout kind's own counters (agent.py: episodes_*)

    def metrics(self) -> dict[str, float]:
        return {**{f"rollout/{k}": float(v) for k, v in self.extra.items()},
            "rollout/started": self.started,
            "rollout/finished": self.finished,
            "rollout/failed": self.failed,
            "rollout/retries": self.retries,
            "rollout/timeouts": self.timeouts,
            "rollout/unavailable": self.unavailable,
            "rollout/tokens": self.tokens,
            "rollout/multi_version_completions": self.version_switches,
        }


class RolloutTimeout(TimeoutError):
    """One generation attempt ran past `trainer.rollout_timeout_s` (it was cancelled in the engine)."""


# A replica that says it is not serving (its engine dead and the replica being replaced, or starting) is waited out,
# the waits doubling up to UNAVAILABLE_MAX_WAIT_S, for UNAVAILABLE_FOR_S at most without using up an attempt: Serve's
# router keeps picking a dead replica until its health check fails (seconds), and with one replica the API has
# nothing else until the new one loaded the live version (tens of seconds on 2 CPU cores)
UNAVAILABLE_FOR_S, UNAVAILABLE_MAX_WAIT_S = 120.0, 4.0


async def generate_with_retry(generate: GenerateFn, request: GenerationRequest, *, attempts: int, counters: RolloutCounters,
                              backoff_s: float = 0.5, timeout_s: float | None = None,
                              stopping: Callable[[], bool] | None = None) -> GenerationResult:
    """Call the engine deployment; a replica that died mid-request, or an attempt that ran past
    `timeout_s` (cancelled, which aborts the request in the engine), is retried (Serve routes the
    retry to a live replica). Re-raises the last error after `attempts` tries, and a request the engine refused
    (`RequestError`: bad sampling parameters, a prompt too long) at once. A replica not serving (`ReplicaNotReady`,
    nothing generated) is retried without counting as an attempt, for `UNAVAILABLE_FOR_S` at most, and not at all once
    `stopping()` (the app is stopping: Serve is taking the engines down too, and the stop must not wait for them)."""
    loop = asyncio.get_running_loop()
    unavailable_until, wait = loop.time() + UNAVAILABLE_FOR_S, backoff_s
    attempt = 0
    while True:
        try:
            deadline = asyncio.timeout(timeout_s)
            try:
                async with deadline:
                    return await generate(request)
            except TimeoutError as err:
                if not deadline.expired():  # the engine's own timeout, not this deadline
                    raise
                counters.timeouts += 1
                raise RolloutTimeout(f"generation attempt {attempt + 1} ran past {timeout_s} s") from err
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - any replica failure is retryable here
            if isinstance(err, RequestError):  # (a refused request is refused again)
                raise
            if replica_unavailable(err):
                if stopping is not None and stopping():
                    raise
                if loop.time() + wait < unavailable_until:
                    counters.unavailable += 1
                    await asyncio.sleep(wait)
                    wait = min(2 * wait, UNAVAILABLE_MAX_WAIT_S)
                    continue
            if attempt == attempts - 1:
                raise
            counters.retries += 1
            log.warning("generation attempt %d failed (%s); retrying", attempt + 1, err)
            await asyncio.sleep(backoff_s * (2**attempt))
            attempt += 1


class RolloutWorkers:
    """`concurrency` asyncio tasks, each looping over: acquire -> prompt -> generate -> score -> push."""

    def __init__(
        self,
        *,
        stream: PromptStream,
        tokenizer: Any,
        generate: GenerateFn,
        rewards: Any,
        buffer: Any,
        algorithm: AlgorithmConfig,
        concurrency: int,
        seed: int,
        seeded: bool = True,
        attempts: int = 3,
        timeout_s: float | None = None,
        backoff_s: float = 0.5,
    ) -> None:
        self._stream = stream
        self._tokenizer = tokenizer
        self._generate = generate
        self._rewards = rewards
        self._buffer = buffer
        self._algo = algorithm
        self._concurrency = concurrency
        self._seed = seed
        self._seeded = seeded  # (False: the engine samples by no seed, and would refuse one: SGLang's default)
        self._attempts = attempts
        self._timeout_s = timeout_s
        self._backoff_s = backoff_s
        self._prompt_cache: dict[tuple[str, tuple[tuple[str, str], ...]], list[int]] = {}
        # reservation keys: unique across workers and restarts of the controller (the buffer may outlive it)
        self._keys, self._key_count = uuid.uuid4().hex[:12], itertools.count()
        self.counters = RolloutCounters()
        # Checkpoints quiesce rollouts: the gate stops new acquisitions, `_active` counts the
        # workers between "about to acquire" and "group pushed", so zero means nothing in flight.
        self._gate = asyncio.Event()
        self._gate.set()
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._stop = asyncio.Event()  # `run`'s: once set, a replica not serving is not waited out

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        key = (prompt.prompt, prompt.messages)
        ids = self._prompt_cache.get(key)
        if ids is None:
            text = render_prompt(self._tokenizer, prompt)
            ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
            self._prompt_cache[key] = ids
        return ids

    def _request(self, index: int, prompt: Prompt) -> GenerationRequest:
        return GenerationRequest(
            prompt_ids=self._prompt_ids(prompt),
            sampling=SamplingParams(
                n=self._algo.group_size,
                temperature=self._algo.temperature,
                top_p=self._algo.top_p,
                max_tokens=self._algo.max_new_tokens,
                seed=request_seed(self._seed, index) if self._seeded else None,
                logprobs=True,
                ignore_eos=self._algo.ignore_eos,
            ),
        )

    async def rollout_once(self, index: int, prompt: Prompt, key: str | None = None) -> None:
        """One prompt's group, with its n slots already acquired by the caller (under `key`)."""
        n = self._algo.group_size
        self.counters.started += 1
        try:
            result = await generate_with_retry(self._generate, self._request(index, prompt), attempts=self._attempts,
                                               counters=self.counters, backoff_s=self._backoff_s, timeout_s=self._timeout_s,
                                               stopping=self._stop.is_set)
        except asyncio.CancelledError:
            await self._buffer.release.remote(n, key=key)
            raise
        except Exception as err:  # noqa: BLE001
            self.counters.failed += 1
            self.counters.errors = (self.counters.errors + [f"prompt {index}: {err!r}"])[-20:]
            log.warning("prompt %d given up on after %d attempts (%r): %d samples counted as dropped_failed",
                        index, self._attempts, err, n)
            await self._buffer.abandon.remote(n, key=key)
            if isinstance(err, RequestError) and err.field not in PROMPT_FIELDS:
                raise RolloutRefused(f"the engine refused this run's rollout requests: {err.field}: "
                                     f"{getattr(err, 'message', err)} (the same for every prompt: a setting of "
                                     "algorithm, trainer or generator; nothing was trained)") from None
            return
        completions = sorted(result.completions, key=lambda c: c.index)
        try:
            outcomes = await self._rewards.score([c.text for c in completions], [prompt.answer] * len(completions),
                                                 [prompt.metadata] * len(completions),
                                                 token_ids=[(result.prompt_ids, list(c.token_ids)) for c in completions])
        except Exception as err:  # noqa: BLE001 - a scorer that raises must not leak the group's slots
            why = f"the reward scorer raised {type(err).__name__}: {err}"[:300]
            log.warning("prompt %d: %s; its %d samples are INVALID_REWARD", index, why, len(completions))
            outcomes = [RewardOutcome(None, SampleStatus.INVALID_REWARD, why)] * len(completions)
        samples = []
        for c, outcome in zip(completions, outcomes):
            aborted = c.finish_reason == "abort" or not c.token_ids
            status = SampleStatus.ABORTED if aborted else outcome.status
            reward = outcome.reward if outcome.reward is not None and status == SampleStatus.VALID else math.nan
            samples.append(
                Sample(
                    prompt_ids=result.prompt_ids,
                    response_ids=list(c.token_ids),
                    behavior_logprobs=list(c.logprobs),
                    versions=list(c.versions),
                    reward=float(reward),
                    group_id=index,
                    prompt_index=index,
                    status=status,
                    finish_reason=c.finish_reason,
                    answer=prompt.answer,
                    metadata={"completion": c.text[:200]},
                    routes=c.routes,
                )
            )
            self.counters.tokens += len(c.token_ids)
            if len(set(c.versions)) > 1:
                self.counters.version_switches += 1
        # Completions missing from the result still hold slots: push them as ABORTED so the
        # buffer counts them rather than leaking reservations.
        for missing in range(len(samples), n):
            samples.append(Sample(prompt_ids=result.prompt_ids, response_ids=[], behavior_logprobs=[], versions=[], reward=math.nan,
                                  group_id=index, prompt_index=index, status=SampleStatus.ABORTED))
        await self._buffer.put_group.remote(samples, key=key)
        self.counters.finished += 1

    async def warm_up(self, prompt: Prompt, requests: int, max_tokens: int = WARM_UP_TOKENS,
                      score_at_least: int = 1) -> dict[str, float]:
        """Before the first step: `requests` generations of `prompt` at once with the rollouts' sampling settings
        (n, temperature, logprobs) but at most `max_tokens` tokens, then their completions scored, repeated up to
        `score_at_least` (a rule pool's worker count: each starts its process). Nothing reaches the buffer and no
        counter moves: the first step then finds the engines' request path and the reward workers already up."""
        t0 = time.perf_counter()
        base = self._request(0, prompt)
        request = GenerationRequest(prompt_ids=base.prompt_ids, sampling=msgspec.structs.replace(
            base.sampling, max_tokens=max(1, min(max_tokens, base.sampling.max_tokens)), seed=None))
        results = await asyncio.gather(*(self._generate(request) for _ in range(max(1, requests))))
        t1 = time.perf_counter()
        done = [(r.prompt_ids, c) for r in results for c in r.completions]
        if done:
            done = (done * -(-score_at_least // len(done)))[:max(score_at_least, len(done))]
            await self._rewards.score([c.text for _, c in done], [prompt.answer] * len(done), [prompt.metadata] * len(done),
                                      token_ids=[(p, list(c.token_ids)) for p, c in done])
        return {"generate_s": t1 - t0, "score_s": time.perf_counter() - t1, "completions": float(len(done))}

    async def quiesce(self) -> None:
        """Stop starting rollouts and wait until none is in flight (every acquired group pushed).
        Checkpoints call this so the saved prompt position and buffer agree exactly."""
        self._gate.clear()
        await self._idle.wait()

    def unquiesce(self) -> None:
        self._gate.set()

    async def _worker(self, stop: asyncio.Event) -> None:
        n = self._algo.group_size
        while not stop.is_set():
            if not self._gate.is_set():
                await asyncio.sleep(0.05)
                continue
            self._active += 1
            self._idle.clear()
            try:
                key = f"{self._keys}-{next(self._key_count)}"  # this reservation's name in the buffer
                if not await self._buffer.acquire.remote(n, timeout_s=1.0, key=key):
                    continue
                if stop.is_set():
                    await self._buffer.release.remote(n, key=key)
                    return
                index, prompt = self._stream.next()
                await self.rollout_once(index, prompt, key)
            finally:
                self._active -= 1
                if self._active == 0:
                    self._idle.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set; in-flight rollouts finish (their groups are pushed)."""
        self._stop = stop
        tasks = [asyncio.create_task(self._worker(stop), name=f"rollout-{i}") for i in range(self._concurrency)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
