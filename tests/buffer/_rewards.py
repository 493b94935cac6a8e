"""Reward functions for the RewardPool tests (imported by path inside spawned workers)."""

from __future__ import annotations

import os


def length_reward(completion: str, answer: str, metadata: dict | None = None) -> float:
    """A well-behaved reward whose value is easy to check: len(completion) + int(answer)."""
    return float(len(completion) + int(answer))


def by_command(completion: str, answer: str, metadata: dict | None = None):
    """Misbehaves as the completion says, so one score() call can exercise every failure."""
    if completion == "loop":
        while True:
            pass
    if completion == "raise":
        raise RuntimeError("boom from the reward function")
    if completion == "none":
        return None
    if completion == "nan":
        return float("nan")
    if completion == "inf":
        return float("inf")
    if completion == "string":
        return "1.0"
    if completion == "die":
        os._exit(3)
    return length_reward(completion, answer, metadata)


NOT_CALLABLE = 42
