"""The prompt record, the JSONL loader for users' data, and chat rendering."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class PromptDataError(ValueError):
    """A prompts file is malformed; the message names the file, line and problem."""


@dataclass(frozen=True)
class Prompt:
    """One question with its reference answer (what the reward compares against)."""

    prompt: str
    answer: str
    metadata: dict[str, str] = field(default_factory=dict)


def _parse_line(raw: str, where: str) -> Prompt:
    try:
        obj: Any = json.loads(raw)
    except json.JSONDecodeError as err:
        raise PromptDataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise PromptDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("prompt", "answer"):
        if key not in obj:
            raise PromptDataError(f"{where}: missing required key {key!r}")
    prompt, answer = obj["prompt"], obj["answer"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise PromptDataError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise PromptDataError(f"{where}: 'answer' must be a string or number, got {answer!r}")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise PromptDataError(f"{where}: 'metadata' must be an object, got {type(metadata).__name__}")
    unknown = set(obj) - {"prompt", "answer", "metadata"}
    if unknown:
        raise PromptDataError(f"{where}: unknown keys {sorted(unknown)} (allowed: prompt, answer, metadata)")
    return Prompt(prompt=prompt, answer=str(answer), metadata={str(k): str(v) for k, v in metadata.items()})


def load_jsonl_prompts(path: str | Path) -> list[Prompt]:
    """Read `{"prompt": ..., "answer": ..., "metadata": {...}?}` lines; blank lines are skipped.

    A malformed line raises PromptDataError naming file and line number; nothing is skipped silently.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"prompts file not found: {path}")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if raw.strip():
                prompts.append(_parse_line(raw, f"{path}:{lineno}"))
    if not prompts:
        raise PromptDataError(f"{path}: no prompts")
    return prompts


def render_chat_prompt(tokenizer: Any, question: str) -> str:
    """The text a chat model sees for one user question, ready for the assistant's answer."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
