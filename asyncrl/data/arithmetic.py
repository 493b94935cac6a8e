"""The embedded demo task: integer arithmetic questions with exact-match answers.

Train and held-out eval splits are disjoint and generated from a seed, so every run (and every
resume) sees the same stream.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from asyncrl.data.prompts import Prompt

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass(frozen=True)
class ArithmeticTask:
    """`What is A op B?` with A, B of up to `digits` digits; answer is the exact integer."""

    digits: int = 2
    operators: tuple[str, ...] = ("+",)
    seed: int = 0
    train_size: int = 20000
    eval_size: int = 200
    _problems: tuple[tuple[int, str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.digits < 1:
            raise ValueError(f"digits={self.digits} must be >= 1")
        bad = [op for op in self.operators if op not in _OPS]
        if bad or not self.operators:
            raise ValueError(f"operators={list(self.operators)!r}: each must be one of {sorted(_OPS)}")
        top = 10**self.digits
        space = top * top * len(self.operators)
        if self.eval_size >= space:
            raise ValueError(f"eval_size={self.eval_size} leaves no training problems (only {space} exist)")
        rng = random.Random(self.seed)
        # Held-out problems are drawn first and excluded from training by identity, so the
        # eval split measures generalisation, not memorisation.
        eval_set: set[tuple[int, str, int]] = set()
        while len(eval_set) < self.eval_size:
            eval_set.add((rng.randrange(top), rng.choice(self.operators), rng.randrange(top)))
        object.__setattr__(self, "_problems", tuple(sorted(eval_set)))

    @staticmethod
    def question(a: int, op: str, b: int) -> str:
        return f"What is {a} {op} {b}?"

    def _prompt(self, a: int, op: str, b: int) -> Prompt:
        # (the question in the metadata too: a judge's prompt template can ask it, {metadata[question]})
        question = self.question(a, op, b)
        return Prompt(prompt=question, answer=str(_OPS[op](a, b)), metadata={"task": "arithmetic", "question": question})

    def eval_split(self) -> list[Prompt]:
        return [self._prompt(*p) for p in self._problems]

    def train_split(self) -> list[Prompt]:
        """`train_size` problems (with repeats once the space is small), never a held-out one."""
        rng = random.Random(self.seed + 1)
        held_out = set(self._problems)
        top = 10**self.digits
        out = []
        while len(out) < self.train_size:
            p = (rng.randrange(top), rng.choice(self.operators), rng.randrange(top))
            if p not in held_out:
                out.append(self._prompt(*p))
        return out
