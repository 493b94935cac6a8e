"""Judge rewards (`reward.kind: http`): an OpenAI-compatible chat model scores each completion.

Owns: rendering the judge prompt (`reward.judge.prompt_template` with {completion}, {answer},
{metadata[KEY]}), the calls (at most `judge.concurrency` at once, each under `judge.timeout_s`,
retried `judge.retries` times after a timeout, a connection error, a 5xx or a 429), parsing the
score (the last match of `judge.score_pattern`, divided by `judge.scale`; with `judge.mode: agree`
the judge's own answer, and the reward is whether the completion's answer equals it) and the
`reward/*` counters. The judge may be any server with `/v1/chat/completions`: vLLM, asyncrl's own gateway (a
second deployment of a model), a hosted API.

Must never: score a failed or unparsable call as 0 (it is INVALID_REWARD with the reason, and its
GRPO group is dropped by the buffer), or wait on the judge without a deadline.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from typing import Any

import httpx

from asyncrl.config import RewardConfig
from asyncrl.rewards.pool import RewardOutcome, TokenIds
from asyncrl.types import SampleStatus

_RETRY_STATUS = {429, 500, 502, 503, 504}
_MAX_ERROR_CHARS = 300


def _same(a: str, b: str) -> bool:
    """Two parsed answers are the same: as numbers where both are finite numbers, else as text."""
    try:
        x, y = float(a), float(b)
    except ValueError:
        return a.strip() == b.strip()
    return x == y if math.isfinite(x) and math.isfinite(y) else a.strip() == b.strip()


class _Metadata(dict):
    """{metadata[KEY]} in the template: a missing key renders empty instead of failing the call."""

    def __missing__(self, key: str) -> str:
        return ""


class HttpJudge:
    """The trainer's reward scorer when reward.kind is http (the RewardPool interface: score, metrics, close)."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        j = config.judge
        self._pattern = re.compile(j.score_pattern)
        key = j.api_key or os.environ.get("ASYNCRL_JUDGE_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._http = httpx.AsyncClient(base_url=j.url.rstrip("/") + "/", headers=headers, timeout=j.timeout_s)
        self._slots = asyncio.Semaphore(j.concurrency)
        self._model = j.model
        self._counts = {"calls": 0, "valid": 0, "invalid": 0, "retries": 0, "timeouts": 0, "http_errors": 0, "unparsable": 0,
                        "agreed": 0}

    async def score(self, completions: list[str], answers: list[str], metadata: list[dict[str, Any]] | None = None,
                    token_ids: TokenIds | None = None) -> list[RewardOutcome]:
        metadata = metadata or [{} for _ in completions]
        return list(await asyncio.gather(*(self._score_one(c, a, m) for c, a, m in zip(completions, answers, metadata))))

    async def _score_one(self, completion: str, answer: str, metadata: dict[str, Any]) -> RewardOutcome:
        try:
            text = self.config.judge.prompt_template.format(completion=completion, answer=answer, metadata=_Metadata(metadata))
        except (KeyError, IndexError, ValueError) as err:
            return self._invalid(f"judge.prompt_template could not be filled: {type(err).__name__}: {err}")
        async with self._slots:
            reply, error = await self._call(text)
        if reply is None:
            return self._invalid(error or "judge call failed")
        found = list(self._pattern.finditer(reply))
        if not found:
            self._counts["unparsable"] += 1
            return self._invalid(f"no score in the judge's reply {reply[:_MAX_ERROR_CHARS]!r} (judge.score_pattern={self._pattern.pattern!r})")
        raw = self._last(found)
        if self.config.judge.mode == "agree":  # the judge's own answer: does the completion's equal it?
            mine = list(self._pattern.finditer(completion))
            agreed = bool(mine) and _same(self._last(mine), raw)
            self._counts["valid"] += 1
            self._counts["agreed"] += int(agreed)
            return RewardOutcome(1.0 if agreed else 0.0, SampleStatus.VALID, None)
        try:
            value = float(raw) / self.config.judge.scale
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            self._counts["unparsable"] += 1
            return self._invalid(f"the judge's score {raw!r} is not a finite number")
        self._counts["valid"] += 1
        return RewardOutcome(value, SampleStatus.VALID, None)

    def _last(self, found: list[re.Match[str]]) -> str:
        return found[-1].group(1) if self._pattern.groups else found[-1].group(0)

    async def _call(self, text: str) -> tuple[str | None, str | None]:
        """(the judge's reply, None), or (None, why) after the last attempt."""
        j = self.config.judge
        why = None
        for attempt in range(j.retries + 1):
            if attempt:
                self._counts["retries"] += 1
                await asyncio.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))
            self._counts["calls"] += 1
            try:
                model = self._model or await self._first_model()
                r = await self._http.post("chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": text}],
                    "max_tokens": j.max_tokens, "temperature": j.temperature})
            except httpx.TimeoutException:
                self._counts["timeouts"] += 1
                why = f"judge call timed out after judge.timeout_s={j.timeout_s:g} s"
                continue
            except httpx.HTTPError as err:
                self._counts["http_errors"] += 1
                why = f"judge unreachable: {type(err).__name__}: {err}"
                continue
            if r.status_code != 200:
                self._counts["http_errors"] += 1
                why = f"judge answered HTTP {r.status_code}: {r.text[:_MAX_ERROR_CHARS]}"
                if r.status_code in _RETRY_STATUS:
                    continue
                return None, why  # 4xx: the request itself is wrong, a retry would get the same
            try:
                return str(r.json()["choices"][0]["message"]["content"] or ""), None
            except (ValueError, KeyError, IndexError, TypeError):
                return None, f"judge reply is not a chat completion: {r.text[:_MAX_ERROR_CHARS]}"
        return None, f"{why} ({j.retries + 1} attempts)"

    async def _first_model(self) -> str:
        r = await self._http.get("models")
        r.raise_for_status()
        self._model = str(r.json()["data"][0]["id"])
        return self._model

    def _invalid(self, why: str) -> RewardOutcome:
        self._counts["invalid"] += 1
        return RewardOutcome(None, SampleStatus.INVALID_REWARD, why[:_MAX_ERROR_CHARS])

    def metrics(self) -> dict[str, float]:
        return {f"reward/judge_{k}": float(v) for k, v in self._counts.items()}

    def close(self) -> None:
        """Close the connection pool (from a running loop: scheduled; else at once)."""
        try:
            asyncio.get_running_loop().create_task(self._http.aclose())
        except RuntimeError:
            asyncio.run(self._http.aclose())
