"""Agent rollouts (`rollout.kind: agent`): a user's async function drives the live OpenAI API over episodes,
and each finished episode becomes one token-exact training sample.

Owns: running `rollout.function` for every member of a prompt's group under the staleness slots the worker
acquired, the episode calls to the gateway (open with the learner's temperature, finish with the reward and any
per-turn rewards), and turning the gateway's samples into `Sample`s. A failed episode is ABORTED, one the gateway
split is SPLIT: either drops its whole group as invalid (a GRPO baseline needs every member), and both are counted.
Must never: re-tokenise what the engine saw, glue a split episode, or leave a slot unaccounted (every acquired
member is pushed, valid or not).
Details: docs/design/trainer.md, "Agent rollouts".
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from asyncrl.config import RolloutConfig
from asyncrl.data.prompts import Prompt
from asyncrl.generator.episodes import EPISODE_HEADER
from asyncrl.rewards.pool import RewardFunctionError, RewardOutcome, resolve_reward_function
from asyncrl.trainer.rollout import RolloutWorkers
from asyncrl.types import Sample, SampleStatus, finite_number

log = logging.getLogger(__name__)

AgentFn = Callable[[Prompt, Any], Awaitable[float]]


class AgentFunctionError(ValueError):
    """rollout.function cannot be loaded, or is not an async function of (prompt, client)."""


def agent_result(value: Any, scored: bool = False) -> tuple[float | None, list[float] | None]:
    """(reward, per-turn rewards or None) of what `rollout.function` returned: a finite number, or a
    mapping `{"reward": r, "turn_rewards": [one per turn of the episode]}`. `scored` (reward.kind model
    or http decides the episode's reward): None, or `{"turn_rewards": [...]}`, and the reward is None.
    Raises ValueError saying what came back otherwise (the episode is then ABORTED)."""
    if scored and value is None:
        return None, None
    if not scored and finite_number(value):
        return float(value), None
    keys = {"turn_rewards"} if scored else {"reward", "turn_rewards"}
    if isinstance(value, dict) and set(value) <= keys and (scored or finite_number(value.get("reward"))):
        reward = None if scored else float(value["reward"])
        per_turn = value.get("turn_rewards")
        if per_turn is None and not scored:
            return reward, None
        if isinstance(per_turn, (list, tuple)) and all(finite_number(r) for r in per_turn):
            return reward, [float(r) for r in per_turn]
    if scored:
        raise ValueError(f"rollout.function returned {value!r}, but the reward scorer (reward.kind) decides each "
                         'episode\'s reward: return None, or {"turn_rewards": [<finite per turn>]}')
    raise ValueError(f"rollout.function returned {value!r}: not a finite number or "
                     '{"reward": <finite>, "turn_rewards": [<finite per turn>]}')


def load_agent_function(path: str) -> AgentFn:
    try:
        obj = resolve_reward_function(path, what="rollout.function")  # the same 'module:function' import
    except RewardFunctionError as err:
        raise AgentFunctionError(f"cannot load it: {err}") from None
    if not inspect.iscoroutinefunction(obj):
        raise AgentFunctionError(f"rollout.function={path!r} is not an async function (async def f(prompt, client) -> reward)")
    return obj


class AgentRollouts(RolloutWorkers):
    """RolloutWorkers whose groups come from `rollout.function` over episodes instead of one engine call."""

    def __init__(self, *, rollout: RolloutConfig, base_url: str, scored: bool = False, **kw: Any) -> None:
        """`scored`: the reward scorer (`rewards`: reward.kind model or http) scores each finished
        episode; else the agent function's return is the reward."""
        super().__init__(**kw)
        assert rollout.function is not None
        self._fn = load_agent_function(rollout.function)
        self._scored = scored
        self._base_url = base_url.rstrip("/")
        self._episode_timeout_s = rollout.episode_timeout_s
        self.counters.extra.update({"episodes_finished": 0, "episodes_failed": 0, "episodes_split": 0, "episode_turns": 0})

    async def rollout_once(self, index: int, prompt: Prompt, key: str | None = None) -> None:
        n = self._algo.group_size
        self.counters.started += 1
        try:
            async with httpx.AsyncClient(base_url=self._base_url, timeout=60.0) as http:
                samples = await asyncio.gather(*(self._episode(http, index, prompt, k) for k in range(n)))
        except asyncio.CancelledError:
            await self._buffer.release.remote(n, key=key)
            raise
        for s in samples:
            self.counters.tokens += sum(s.response_mask)  # sampled tokens only
        await self._buffer.put_group.remote(list(samples), key=key)
        self.counters.finished += 1

    async def evaluate(self, prompts: list[Prompt], concurrency: int = 32, scorer: Any = None) -> float:
        """Mean return of the agent on `prompts` (reward plus per-turn rewards) with greedy turns
        (episodes pinned at temperature 0, finished and not trained on); an episode that fails scores 0."""
        if not prompts:
            return float("nan")
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, p: Prompt) -> float:
            async with sem:
                eid = None
                try:
                    r = await http.post("/v1/episodes", json={"metadata": {"eval": True, "prompt": i}, "temperature": 0.0})
                    r.raise_for_status()
                    eid = r.json()["id"]
                    try:  # the episode's return: its reward plus its per-turn rewards
                        reward, per_turn = agent_result(await self._run_agent(p, eid), self._scored)
                    except ValueError:
                        reward, per_turn = 0.0, None
                    done = await http.post(f"/v1/episodes/{eid}/finish", json={"reward": reward or 0.0})  # not trained on
                    if reward is None:  # scored: the eval scorer's outcome on the episode's only sample
                        samples = done.json()["samples"] if done.status_code == 200 else []
                        outcome = await self._score_episode(p, samples[0], scorer) if len(samples) == 1 else None
                        reward = outcome.reward if outcome is not None and outcome.reward is not None else 0.0
                    return reward + sum(per_turn or ())
                except asyncio.CancelledError:
                    raise
                except Exception as err:  # noqa: BLE001 - an eval episode that fails scores 0
                    log.warning("eval episode %s (prompt %d) failed: %r", eid, i, err)
                    return 0.0

        async with httpx.AsyncClient(base_url=self._base_url, timeout=60.0) as http:
            scores = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return sum(scores) / len(scores)

    async def _run_agent(self, prompt: Prompt, eid: str) -> Any:
        """`rollout.function` on `prompt` with a client bound to episode `eid`, under rollout.episode_timeout_s."""
        import openai

        client = openai.AsyncOpenAI(base_url=f"{self._base_url}/v1", api_key="asyncrl", max_retries=0,
                                    default_headers={EPISODE_HEADER: eid})
        try:
            async with asyncio.timeout(self._episode_timeout_s):
                return await self._fn(prompt, client)
        finally:
            await client.close()

    async def _episode(self, http: httpx.AsyncClient, index: int, prompt: Prompt, member: int) -> Sample:
        def failed(status: SampleStatus, why: str) -> Sample:
            key = "episodes_split" if status == SampleStatus.SPLIT else "episodes_failed"
            self.counters.extra[key] += 1
            self.counters.errors = (self.counters.errors + [f"prompt {index} episode {member}: {why}"])[-20:]
            return Sample(prompt_ids=[], response_ids=[], behavior_logprobs=[], versions=[], reward=math.nan,
                          group_id=index, prompt_index=index, status=status, answer=prompt.answer, metadata={"error": why[:200]})

        r = await http.post("/v1/episodes", json={"metadata": {"prompt_index": index, "member": member},
                                                  "temperature": self._algo.temperature})
        if r.status_code != 201:
            return failed(SampleStatus.ABORTED, f"opening the episode: HTTP {r.status_code} {r.text[:200]}")
        eid = r.json()["id"]
        try:
            reward = await self._run_agent(prompt, eid)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            return failed(SampleStatus.ABORTED, f"ran past rollout.episode_timeout_s={self._episode_timeout_s:g}")
        except Exception as err:  # noqa: BLE001 - the user's agent code failed
            return failed(SampleStatus.ABORTED, f"rollout.function raised {type(err).__name__}: {err}")
        try:
            reward, turn_rewards = agent_result(reward, self._scored)
        except ValueError as err:
            return failed(SampleStatus.ABORTED, str(err))
        # scored: the gateway only echoes the finish's reward; the scorer's comes below
        body: dict[str, Any] = {"reward": 0.0 if reward is None else reward}
        if turn_rewards is not None:
            body["turn_rewards"] = turn_rewards
        r = await http.post(f"/v1/episodes/{eid}/finish", json=body)
        if r.status_code != 200:
            return failed(SampleStatus.ABORTED, f"finishing the episode: HTTP {r.status_code} {r.text[:200]}")
        done = r.json()
        if len(done["samples"]) != 1:
            return failed(SampleStatus.SPLIT, f"{done['mismatches']} turn(s) did not extend the tokens before them")
        s = done["samples"][0]
        self.counters.extra["episodes_finished"] += 1
        self.counters.extra["episode_turns"] += s["turns"]
        if len(set(s["versions"])) > 1:
            self.counters.version_switches += 1
        status, error = SampleStatus.VALID, None
        if reward is None:
            outcome = await self._score_episode(prompt, s)
            status, error = outcome.status, outcome.error
            reward = outcome.reward if outcome.reward is not None and status == SampleStatus.VALID else math.nan
        return Sample(prompt_ids=s["prompt_ids"], response_ids=s["response_ids"], behavior_logprobs=s["logprobs"],
                      versions=s["versions"], loss_mask=s["loss_mask"], reward=reward, group_id=index,
                      prompt_index=index, answer=prompt.answer, finish_reason="episode", status=status,
                      metadata={"episode": eid, "turns": str(s["turns"]), **({"error": error[:200]} if error else {})},
                      turn_rewards=s.get("turn_rewards"), turn_ends=s["turn_ends"] if s.get("turn_rewards") is not None else None)

    async def _score_episode(self, prompt: Prompt, sample: dict[str, Any], scorer: Any = None) -> RewardOutcome:
        """The reward scorer's outcome for a finished episode's sample: a reward model reads its tokens
        (the first prompt and everything after it), a judge or a rule the text of its last turn (the
        final answer). A scorer that raises makes the sample INVALID_REWARD with the reason."""
        mask, ids = sample["loss_mask"], sample["response_ids"]
        start = len(ids)
        while start > 0 and mask[start - 1]:
            start -= 1
        text = self._tokenizer.decode(ids[start:], skip_special_tokens=True)
        try:
            (outcome,) = await (scorer or self._rewards).score([text], [prompt.answer], [dict(prompt.metadata)],
                                                               token_ids=[(sample["prompt_ids"], ids)])
            return outcome
        except Exception as err:  # noqa: BLE001 - a scorer that raises must not leak the group's slots
            return RewardOutcome(None, SampleStatus.INVALID_REWARD, f"the reward scorer raised {type(err).__name__}: {err}"[:300])
