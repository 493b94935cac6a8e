"""Multi-turn episodes over the OpenAI API: what the engine saw and sampled, turn by turn.

Owns: the episode ledger a gateway keeps (open -> turns -> finish, or abandoned past its idle timeout), the limits
of one episode (turns, tokens), and assembling a finished episode into token-exact training samples (`assemble`).
Each turn records the prompt ids the engine got, the sampled ids, their log-probs and weight versions. A turn whose
prompt extends everything before it extends the sample (new prompt tokens with loss mask 0, sampled ones 1); one
that does not starts a new sample and counts as a mismatch.
Must never: re-tokenise text, glue tokens across a mismatch, drop a recorded turn without counting it, or hold an
episode past its idle timeout (it is dropped and counted as abandoned).
Details: docs/design/generator.md, "Multi-turn episodes".
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

EPISODE_HEADER = "x-asyncrl-episode"


class EpisodeError(Exception):
    """A request the episode's state refuses; `status` is the HTTP status the gateway answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Turn:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]


@dataclass
class EpisodeSample:
    """One training sample of an episode: `response_ids` hold every token after the first prompt,
    `loss_mask` 1 on the sampled ones; masked tokens carry log-prob 0.0 and the version of the
    sampled token before them."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0
    turn_ends: list[int] = field(default_factory=list)  # per turn: the index in response_ids of its last sampled token

    def as_json(self) -> dict[str, Any]:
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids, "loss_mask": self.loss_mask,
                "logprobs": self.logprobs, "versions": self.versions, "turns": self.turns, "turn_ends": self.turn_ends}


def assemble(turns: Sequence[Turn]) -> tuple[list[EpisodeSample], int]:
    """The samples of `turns` and how many turns did not extend the sample before them."""
    samples: list[EpisodeSample] = []
    mismatches = 0
    context: list[int] = []
    for turn in turns:
        prompt = list(turn.prompt_ids)
        cur = samples[-1] if samples else None
        if cur is not None and len(prompt) >= len(context) and prompt[: len(context)] == context:
            extension = prompt[len(context):]
            carried = cur.versions[-1] if cur.versions else (turn.versions[0] if turn.versions else 0)
            cur.response_ids += extension
            cur.loss_mask += [0] * len(extension)
            cur.logprobs += [0.0] * len(extension)
            cur.versions += [carried] * len(extension)
        else:
            if cur is not None:
                mismatches += 1
            cur = EpisodeSample(prompt_ids=prompt)
            samples.append(cur)
        cur.response_ids += turn.token_ids
        cur.loss_mask += [1] * len(turn.token_ids)
        cur.logprobs += turn.logprobs
        cur.versions += turn.versions
        cur.turns += 1
        cur.turn_ends.append(len(cur.response_ids) - 1)
        context = prompt + list(turn.token_ids)
    return samples, mismatches


@dataclass
class _Episode:
    id: str
    touched: float
    metadata: dict[str, Any]
    turns: list[Turn] = field(default_factory=list)
    busy: bool = False  # a turn is being generated
    temperature: float | None = None  # every turn must sample at it (the learner recomputes log-probs at it)


class EpisodeLedger:
    """Open episodes of one gateway (single event loop: no locks)."""

    def __init__(self, *, max_turns: int, max_tokens: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, remember: int = 4096) -> None:
        self.max_turns, self.max_tokens, self.idle_timeout_s = max_turns, max_tokens, idle_timeout_s
        self._clock = clock
        self._open: dict[str, _Episode] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()  # id -> "finished" | "abandoned" (bounded)
        self._remember = remember
        self._seq = itertools.count()
        self.counters = {"opened": 0, "finished": 0, "abandoned": 0, "turns": 0, "mismatches": 0,
                         "samples": 0, "refused": 0}

    # ---- lifecycle -----------------------------------------------------------------------------

    def open(self, metadata: dict[str, Any] | None = None, temperature: float | None = None) -> dict[str, Any]:
        """A new episode; with `temperature`, every turn must sample at it (a trainer's episodes: the
        learner recomputes the log-probs at algorithm.temperature)."""
        self.reap()
        eid = f"ep-{next(self._seq)}-{uuid.uuid4().hex[:12]}"
        self._open[eid] = _Episode(id=eid, touched=self._clock(), metadata=dict(metadata or {}), temperature=temperature)
        self.counters["opened"] += 1
        return {"id": eid, "max_turns": self.max_turns, "max_tokens": self.max_tokens, "idle_timeout_s": self.idle_timeout_s,
                "temperature": temperature}

    def begin_turn(self, eid: str, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0) -> None:
        """Before a turn is generated: the episode exists, is open, idle, and the turn fits its limits."""
        ep = self._get(eid)
        if ep.temperature is not None and temperature != ep.temperature:
            self._refuse(400, f"episode {eid} samples at temperature {ep.temperature:g} (the learner's "
                              f"algorithm.temperature); this turn asked for {temperature:g}")
        if ep.busy:
            self._refuse(409, f"episode {eid} already has a turn in flight; send its turns one after another")
        if len(ep.turns) >= self.max_turns:
            self._refuse(413, f"episode {eid} has {len(ep.turns)} turns, the most one episode may have "
                              f"(generator.episode_max_turns={self.max_turns}); finish it")
        total = self._tokens(ep.turns, prompt_ids, max_new_tokens)
        if total > self.max_tokens:
            self._refuse(413, f"episode {eid} would reach {total} tokens with this turn (prompt {len(prompt_ids)} + "
                              f"max_tokens {max_new_tokens}) > generator.episode_max_tokens={self.max_tokens}; finish it "
                              "or ask for fewer tokens")
        ep.busy = True
        ep.touched = self._clock()

    def end_turn(self, eid: str, turn: Turn | None) -> None:
        """After a turn: record it (None: the generation failed, nothing is recorded)."""
        ep = self._open.get(eid)
        if ep is None:  # reaped while generating (cannot happen while busy) or finished concurrently
            return
        ep.busy = False
        ep.touched = self._clock()
        if turn is not None:
            ep.turns.append(turn)
            self.counters["turns"] += 1

    def finish(self, eid: str) -> tuple[list[EpisodeSample], int, dict[str, Any]]:
        """Close the episode: its samples, its mismatch count and its metadata."""
        ep = self._get(eid)
        if ep.busy:
            self._refuse(409, f"episode {eid} has a turn in flight; finish it after the turn returns")
        if not ep.turns:
            self._refuse(409, f"episode {eid} has no turns: nothing to train on (finish it after at least one "
                              "chat completion sent with the x-asyncrl-episode header)")
        samples, mismatches = assemble(ep.turns)
        del self._open[eid]
        self._close(eid, "finished")
        self.counters["finished"] += 1
        self.counters["mismatches"] += mismatches
        self.counters["samples"] += len(samples)
        return samples, mismatches, ep.metadata

    def reap(self) -> list[str]:
        """Drop episodes idle past the timeout (counted as abandoned); returns their ids."""
        now = self._clock()
        gone = [e.id for e in self._open.values() if not e.busy and now - e.touched > self.idle_timeout_s]
        for eid in gone:
            del self._open[eid]
            self._close(eid, "abandoned")
        self.counters["abandoned"] += len(gone)
        return gone

    def temperature(self, eid: str) -> float | None:
        """The temperature `eid`'s turns sample at when the request names none (None: unpinned or unknown)."""
        ep = self._open.get(eid)
        return ep.temperature if ep is not None else None

    def describe(self, eid: str) -> dict[str, Any]:
        ep = self._get(eid)
        return {"id": eid, "state": "generating" if ep.busy else "open", "turns": len(ep.turns),
                "tokens": self._tokens(ep.turns, (), 0), "metadata": ep.metadata,
                "idle_s": self._clock() - ep.touched}

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "open": len(self._open)}

    # ---- helpers -------------------------------------------------------------------------------

    def _get(self, eid: str) -> _Episode:
        self.reap()
        ep = self._open.get(eid)
        if ep is not None:
            return ep
        state = self._closed.get(eid)
        if state == "finished":
            self._refuse(409, f"episode {eid} is finished; open a new one")
        if state == "abandoned":
            self._refuse(410, f"episode {eid} was abandoned: idle for more than generator.episode_idle_timeout_s="
                              f"{self.idle_timeout_s:g} s")
        self._refuse(404, f"episode {eid!r} not found (open one with POST /v1/episodes)")
        raise AssertionError  # unreachable

    def _refuse(self, status: int, message: str) -> None:
        self.counters["refused"] += 1
        raise EpisodeError(status, message)

    def _close(self, eid: str, state: str) -> None:
        self._closed[eid] = state
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)

    @staticmethod
    def _tokens(turns: Sequence[Turn], prompt_ids: Sequence[int], max_new_tokens: int) -> int:
        """Tokens of the episode's samples if the next turn (`prompt_ids`, up to `max_new_tokens`)
        extends them: the first prompt, then every new prompt token and every sampled token."""
        samples, _ = assemble(list(turns) + ([Turn(tuple(prompt_ids), (), (), ())] if prompt_ids else []))
        return sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) + max_new_tokens
