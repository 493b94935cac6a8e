"""Rule rewards for answers that are a number."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def extract_final_integer(text: str) -> int | None:
    """The last integer in `text`, or None when there is none."""
    found = _INT.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def exact_integer_reward(completion: str, answer: str, metadata: dict[str, str] | None = None) -> float:
    """1.0 when the completion's final integer equals the reference answer exactly, else 0.0."""
    predicted = extract_final_integer(completion)
    return 1.0 if predicted is not None and predicted == int(answer) else 0.0
