"""The embedded task as a two-turn agent: a question, the model's answer, then a follow-up that
builds on the first answer ("Add C to that."), with half the reward for each correct answer.

    rollout: {kind: agent, function: asyncrl.agents.arithmetic:two_step}

C comes from the question (1..9, stable per prompt), so a group's members get the same follow-up.
The client is bound to the episode and samples at the learner's temperature (the gateway's default
for the episode's turns).
"""

from __future__ import annotations

import re
import zlib
from typing import Any

from asyncrl.data.prompts import Prompt

_INTEGER = re.compile(r"-?\d+")
_model_names: dict[str, str] = {}


def follow_up_addend(question: str) -> int:
    return zlib.crc32(question.encode()) % 9 + 1


def last_integer(text: str | None) -> int | None:
    found = _INTEGER.findall(text or "")
    return int(found[-1]) if found else None


async def _model(client: Any) -> str:
    key = str(client.base_url)
    if key not in _model_names:
        _model_names[key] = (await client.models.list()).data[0].id
    return _model_names[key]


async def two_step(prompt: Prompt, client: Any, max_tokens: int = 8) -> float:
    model = await _model(client)
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt.prompt}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
    answer = first.choices[0].message.content or ""
    addend = follow_up_addend(prompt.prompt)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Add {addend} to that."}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
    truth = int(prompt.answer)
    reward = 0.5 * (last_integer(answer) == truth)
    reward += 0.5 * (last_integer(second.choices[0].message.content) == truth + addend)
    return reward
