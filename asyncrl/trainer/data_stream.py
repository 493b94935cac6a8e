"""A resumable, seeded stream of prompts.

Owns: the order in which training prompts are visited (a fresh seeded permutation per epoch)
and its position, so a run stopped and resumed continues the same sample stream.
Must never: tokenize, or skip a prompt without advancing the position.
"""

from __future__ import annotations

import random
from typing import Any

from asyncrl.data.prompts import Prompt


class PromptStream:
    """Endless iterator over `prompts`, reshuffled (from `seed` and the epoch) at every epoch."""

    def __init__(self, prompts: list[Prompt], seed: int) -> None:
        if not prompts:
            raise ValueError("PromptStream needs at least one prompt")
        self._prompts = prompts
        self._seed = seed
        self._epoch = 0
        self._pos = 0
        self._consumed = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self._prompts)))
        random.Random(self._seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> tuple[int, Prompt]:
        """(global stream index, prompt). The index is unique over the whole run."""
        if self._pos == len(self._order):
            self._epoch += 1
            self._pos = 0
            self._order = self._permutation(self._epoch)
        prompt = self._prompts[self._order[self._pos]]
        self._pos += 1
        index = self._consumed
        self._consumed += 1
        return index, prompt

    def peek(self) -> Prompt:
        """The prompt `next` returns next, the position left where it is (the start's warm-up request)."""
        if self._pos == len(self._order):
            return self._prompts[self._permutation(self._epoch + 1)[0]]
        return self._prompts[self._order[self._pos]]

    @property
    def consumed(self) -> int:
        return self._consumed

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "pos": self._pos, "consumed": self._consumed, "seed": self._seed, "size": len(self._prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["size"] != len(self._prompts) or state["seed"] != self._seed:
            raise ValueError(
                f"prompt stream state is for {state['size']} prompts / seed {state['seed']}, "
                f"this run has {len(self._prompts)} / seed {self._seed}"
            )
        self._epoch, self._pos, self._consumed = state["epoch"], state["pos"], state["consumed"]
        self._order = self._permutation(self._epoch)
