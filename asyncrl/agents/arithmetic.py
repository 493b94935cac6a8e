"""The embedded task as a two-turn agent: a question, the model's answer, then a follow-up that
builds on the first answer ("Add C to that."), with half the reward for each correct answer.

    rollout: {kind: agent, function: asyncrl.agents.arithmetic:two_step}
or, the same return as one reward per turn, `asyncrl.agents.arithmetic:two_step_per_turn`.

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


async def _two_turns(prompt: Prompt, client: Any, max_tokens: int) -> tuple[bool, bool]:
    """Whether the first answer and the follow-up's answer are right."""
    model = await _model(client)
    messages: list[dict[str, str]] = [{"role": "user", "content": prompt.prompt}]
    first = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
    answer = first.choices[0].message.content or ""
    addend = follow_up_addend(prompt.prompt)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"Add {addend} to that."}]
    second = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
    truth = int(prompt.answer)
    return last_integer(answer) == truth, last_integer(second.choices[0].message.content) == truth + addend


async def two_step(prompt: Prompt, client: Any, max_tokens: int = 8) -> float:
    """Half the reward for each right answer, as one reward for the episode."""
    first, second = await _two_turns(prompt, client, max_tokens)
    return 0.5 * first + 0.5 * second


async def two_step_per_turn(prompt: Prompt, client: Any, max_tokens: int = 8) -> dict[str, Any]:
    """The same return as `two_step`, as per-turn rewards: each answer's half on its own turn, so that
    token-level advantages (reinforce_pp, gae) credit the second turn with the second answer alone."""
    first, second = await _two_turns(prompt, client, max_tokens)
    return {"reward": 0.0, "turn_rewards": [0.5 * first, 0.5 * second]}
