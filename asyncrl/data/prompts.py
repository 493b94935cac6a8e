"""The prompt record, one row parser for every prompt file format, the JSONL loader, and chat rendering.

Owns: what a valid prompt row is (a text prompt or a chat of messages, an answer, optional
metadata), found through a column mapping, and the error that names the file and row of a bad one.
Must never: skip a malformed row silently, or tokenize.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class PromptDataError(ValueError):
    """A prompts file is malformed; the message names the file, line or row, and problem."""


@dataclass(frozen=True)
class Prompt:
    """One question with its reference answer (what the reward compares against).

    `messages` set: the prompt is that chat (role, content pairs, as verl and TRL datasets keep
    it), rendered with the chat template as is; `prompt` then holds its last user turn (for logs).
    Empty: `prompt` is the user's question, rendered as one user message."""

    prompt: str
    answer: str
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ColumnMap:
    """Which fields of a row hold the prompt, answer and metadata. A name may be a dotted path into
    nested objects (`reward_model.ground_truth`, verl's layout). `metadata`: one field holding an
    object, a list of fields copied by name, or None for the `metadata` field when there is one."""

    prompt: str = "prompt"
    answer: str = "answer"
    metadata: str | tuple[str, ...] | None = None

    def is_default(self) -> bool:
        return self == ColumnMap()

    def top_level(self) -> set[str]:
        """The row keys (columns) this mapping reads, before any dot."""
        names = [self.prompt, self.answer]
        names += [self.metadata] if isinstance(self.metadata, str) else list(self.metadata or ())
        return {n.split(".")[0] for n in names}


_MISSING = object()


def _lookup(row: Mapping[str, Any], path: str) -> Any:
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)


def _messages(value: list[Any], where: str, name: str) -> tuple[tuple[str, str], ...]:
    if not value:
        raise PromptDataError(f"{where}: {name!r} is an empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise PromptDataError(f"{where}: {name}[{i}] must be a message object with role and content, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise PromptDataError(f"{where}: {name}[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise PromptDataError(f"{where}: {name}[{i}].content must be a string, got {type(content).__name__}")
        out.append((role, content))
    if not any(role == "user" and content.strip() for role, content in out):
        raise PromptDataError(f"{where}: {name!r} has no non-empty user message")
    return tuple(out)


def parse_row(row: Any, where: str, columns: ColumnMap = ColumnMap(), *, strict: bool = False) -> Prompt:
    """The Prompt of one row (a JSON object, a parquet / dataset row as a dict).

    Raises PromptDataError naming `where` (file and line or row) and the problem. `strict`: keys
    the mapping does not read are refused (the documented JSONL format)."""
    if not isinstance(row, Mapping):
        raise PromptDataError(f"{where}: expected an object, got {type(row).__name__}")
    for key in (columns.prompt, columns.answer):
        if _lookup(row, key) is _MISSING:
            raise PromptDataError(f"{where}: missing required key {key!r}")
    prompt, answer = _lookup(row, columns.prompt), _lookup(row, columns.answer)
    messages: tuple[tuple[str, str], ...] = ()
    if isinstance(prompt, (list, tuple)):
        messages = _messages(list(prompt), where, columns.prompt)
        prompt = next(c for r, c in reversed(messages) if r == "user" and c.strip())
    elif not isinstance(prompt, str) or not prompt.strip():
        raise PromptDataError(f"{where}: {columns.prompt!r} must be a non-empty string or a list of chat messages, got {prompt!r}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise PromptDataError(f"{where}: {columns.answer!r} must be a string or number, got {answer!r}")
    metadata: dict[str, str] = {}
    if isinstance(columns.metadata, tuple):
        for name in columns.metadata:
            value = _lookup(row, name)
            if value is _MISSING:
                raise PromptDataError(f"{where}: missing metadata key {name!r}")
            metadata[name] = _text(value)
    else:
        name = columns.metadata or "metadata"
        value = _lookup(row, name)
        if value is _MISSING and columns.metadata is not None:
            raise PromptDataError(f"{where}: missing metadata key {name!r}")
        if value is not _MISSING and value is not None:
            if not isinstance(value, Mapping):
                raise PromptDataError(f"{where}: {name!r} must be an object, got {type(value).__name__}")
            metadata = {str(k): _text(v) for k, v in value.items()}
    if strict:
        unknown = set(row) - columns.top_level() - {"metadata"}
        if unknown:
            raise PromptDataError(f"{where}: unknown keys {sorted(unknown)} (allowed: prompt, answer, metadata)")
    return Prompt(prompt=prompt, answer=str(answer), metadata=metadata, messages=messages)


def load_jsonl_prompts(path: str | Path, columns: ColumnMap = ColumnMap()) -> list[Prompt]:
    """Read `{"prompt": ..., "answer": ..., "metadata": {...}?}` lines; blank lines are skipped.
    `prompt` may be a list of chat messages. With the default columns other keys are refused;
    a column mapping reads its fields and ignores the rest.

    A malformed line raises PromptDataError naming file and line number; nothing is skipped silently.
    """
    path = Path(path)
    if not path.is_file():
        raise PromptDataError(f"prompts file not found: {path}")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj: Any = json.loads(raw)
            except json.JSONDecodeError as err:
                raise PromptDataError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise PromptDataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            prompts.append(parse_row(obj, where, columns, strict=columns.is_default()))
    if not prompts:
        raise PromptDataError(f"{path}: no prompts")
    return prompts


def render_chat_prompt(tokenizer: Any, question: str) -> str:
    """The text a chat model sees for one user question, ready for the assistant's answer."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


def render_prompt(tokenizer: Any, prompt: Prompt) -> str:
    """The text a chat model sees for `prompt`: its chat as given, or its question as one user turn."""
    if not prompt.messages:
        return render_chat_prompt(tokenizer, prompt.prompt)
    return tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in prompt.messages], tokenize=False, add_generation_prompt=True
    )
