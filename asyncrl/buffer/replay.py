"""The replay buffer: accepted GRPO groups waiting to be trained, and the sample accounting.

Owns: the queue of whole groups, the invalid / group-filter / stale drops, batch assembly, the counters of the
accounting identity, and the buffer part of a checkpoint. Groups stay whole: one invalid member drops its group (a
missing member biases the GRPO baseline; ragged groups could deadlock admission), staleness is judged by a group's
oldest token, and batches are whole groups, oldest first. A rollout given up on counts as generated and
dropped_failed. `put_group` raises BufferFullError past `capacity` (changing nothing), except while the waiting
samples cannot form a batch or the learner may wait for the group (`force`), so learner and producers never wait
on each other.
Must never: wait, know about Ray or admission control, or let a sample vanish uncounted:
    generated = trained + dropped_stale + dropped_invalid + dropped_filtered + dropped_failed + waiting
Details: docs/design/buffer.md, "The replay buffer".
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Sequence

import msgspec

from asyncrl.config import BufferConfig
from asyncrl.types import PutResult, Sample, SampleStatus, TrainBatch

_FORMAT = 1
log = logging.getLogger(__name__)


class BufferFullError(RuntimeError):
    """The buffer holds `capacity` samples; the caller should wait for the learner to draw."""


@dataclasses.dataclass
class BufferCounts:
    generated: int = 0  # samples ever pushed
    trained: int = 0  # samples handed out in batches
    dropped_stale: int = 0
    dropped_invalid: int = 0
    dropped_filtered: int = 0
    dropped_failed: int = 0  # reserved samples of rollouts given up on (generation failed / timed out)
    invalid_samples: int = 0  # samples that were themselves invalid (subset of dropped_invalid)
    batches: int = 0


def group_is_valid(samples: Sequence[Sample]) -> bool:
    return all(_sample_is_valid(s) for s in samples)


def _sample_is_valid(s: Sample) -> bool:
    return s.status == SampleStatus.VALID and math.isfinite(s.reward) and len(s.versions) > 0


class ReplayBuffer:
    """Whole GRPO groups, drawn oldest first (FIFO among equals), with exact sample accounting. Not
    thread-safe: one owner."""

    def __init__(self, config: BufferConfig) -> None:
        if not isinstance(config, BufferConfig):
            raise TypeError(f"config must be a BufferConfig, got {type(config).__name__}")
        self.config = config
        self._groups: collections.deque[list[Sample]] = collections.deque()
        self._waiting = 0
        self.counts = BufferCounts()
        self._last_staleness = (0.0, 0.0)  # (mean, max) of v - oldest_version in the last batch
        # group_id -> (version its rollout was admitted at, or None; version when it arrived): what a stale drop logs
        self._origin: dict[Any, tuple[int | None, int]] = {}

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def waiting_groups(self) -> int:
        return len(self._groups)

    # -- put ------------------------------------------------------------------------------------
    def validate_group(self, samples: Sequence[Sample]) -> None:
        """Raise ValueError/TypeError for malformed input (never for merely invalid rewards)."""
        if not isinstance(samples, (list, tuple)) or not samples:
            raise ValueError(f"a group is a non-empty list of Sample, got {type(samples).__name__} {samples!r:.80}")
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"group member {i} is a {type(s).__name__}, not a Sample")
            if len(s.versions) != len(s.response_ids) or len(s.behavior_logprobs) != len(s.response_ids):
                raise ValueError(
                    f"group member {i}: {len(s.response_ids)} response tokens but {len(s.versions)} versions "
                    f"and {len(s.behavior_logprobs)} log-probs"
                )
        ids = {s.group_id for s in samples}
        if len(ids) != 1:
            raise ValueError(f"a group shares one group_id, got {sorted(ids)}")
        if len(samples) > self.config.batch_size:
            raise ValueError(f"group of {len(samples)} samples exceeds batch_size={self.config.batch_size}")
        gid = samples[0].group_id
        if any(g[0].group_id == gid for g in self._groups):
            raise ValueError(f"group_id={gid} is already waiting in the buffer (groups are pushed once, whole)")

    def admits(self, samples: Sequence[Sample]) -> int:
        """How many of `samples` put_group would keep: 0 or all of them (validates first)."""
        self.validate_group(samples)
        if not group_is_valid(samples):
            return 0
        if self.config.group_filter == "all_equal" and len({s.reward for s in samples}) == 1:
            return 0
        return len(samples)

    def has_room(self, samples: Sequence[Sample]) -> bool:
        """Whether put_group would accept the group now (filtered/invalid groups always fit)."""
        return self._room_for(self.admits(samples))

    def _room_for(self, kept: int) -> bool:
        return (
            kept == 0
            or self._waiting + kept <= self.config.capacity
            or not self.batch_ready(self.config.batch_size)
        )

    def put_group(self, samples: Sequence[Sample], force: bool = False, admitted: int | None = None,
                  version: int = 0) -> PutResult:
        """Push one whole group; drops invalid / filtered groups (counted). Raises BufferFullError
        (unless `force`: a group a draw may wait for, BufferCore._may_be_waited_for). `admitted` (the version its
        rollout was admitted at) and `version` (now) only go into the log line of a stale drop."""
        kept = self.admits(samples)
        if not force and not self._room_for(kept):
            raise BufferFullError(
                f"buffer holds {self._waiting} of capacity={self.config.capacity} samples; "
                f"cannot add a group of {kept}"
            )
        n = len(samples)
        self.counts.generated += n
        if not group_is_valid(samples):
            self.counts.dropped_invalid += n
            self.counts.invalid_samples += sum(not _sample_is_valid(s) for s in samples)
            return PutResult(kept=0, dropped_invalid=n, dropped_filtered=0)
        if kept == 0:
            self.counts.dropped_filtered += n
            return PutResult(kept=0, dropped_invalid=0, dropped_filtered=n)
        self._groups.append(list(samples))
        self._waiting += n
        self._origin[samples[0].group_id] = (admitted, version)
        return PutResult(kept=n, dropped_invalid=0, dropped_filtered=0)

    def abandon(self, n: int) -> None:
        """Count the n reserved samples of a rollout that was given up on (never pushed)."""
        if not isinstance(n, int) or n <= 0:
            raise ValueError(f"abandon(n={n!r}): n must be a positive int")
        self.counts.generated += n
        self.counts.dropped_failed += n

    # -- get ------------------------------------------------------------------------------------
    def drop_stale(self, current_version: int, max_staleness: int) -> int:
        """Drop every waiting group whose oldest token version is < v - eta; return samples dropped."""
        floor = current_version - max_staleness
        keep = collections.deque(g for g in self._groups if min(s.oldest_version for s in g) >= floor)
        for g in self._groups:
            if self._oldest(g) < floor:
                admitted, arrived = self._origin.get(g[0].group_id, (None, -1))
                log.warning("stale drop at version %d (eta %d): group %s of %d samples, oldest token version %d, "
                            "admitted at %s, arrived at %d; %d samples waiting", current_version, max_staleness,
                            g[0].group_id, len(g), self._oldest(g), admitted, arrived, self._waiting)
                self._origin.pop(g[0].group_id, None)
        dropped = self._waiting - sum(len(g) for g in keep)
        self._groups = keep
        self._waiting -= dropped
        self.counts.dropped_stale += dropped
        return dropped

    @staticmethod
    def _oldest(group: list[Sample]) -> int:
        return min(s.oldest_version for s in group)

    def _prefix(self, batch_size: int) -> tuple[int, bool]:
        """(groups, ready) of the FIFO prefix of at most batch_size samples."""
        total = 0
        for i, g in enumerate(self._groups):
            if total + len(g) > batch_size:
                if i == 0:
                    raise ValueError(f"the oldest group has {len(g)} samples, more than batch_size={batch_size}")
                return i, True
            total += len(g)
            if total == batch_size:
                return i + 1, True
        return len(self._groups), False

    def batch_ready(self, batch_size: int) -> bool:
        return self._prefix(batch_size)[1]

    def get_batch(self, batch_size: int, current_version: int, max_staleness: int) -> TrainBatch | None:
        """Drop stale groups, then pop whole groups (oldest first) for one batch, or None if none is ready."""
        n_groups = self.plan_batch(batch_size, current_version, max_staleness)
        return None if n_groups is None else self.take(n_groups, current_version)

    def plan_batch(self, batch_size: int, current_version: int, max_staleness: int) -> int | None:
        """Drop stale groups and order the rest oldest first (by each group's oldest token; arrival order among
        equals: a group that took long to generate is the next to go stale, so it goes before younger groups
        that arrived earlier); the number of leading groups the next batch takes, or None if none is ready."""
        if batch_size <= 0 or current_version < 0 or max_staleness < 0:
            raise ValueError(
                f"get_batch(batch_size={batch_size}, current_version={current_version}, "
                f"max_staleness={max_staleness}): all must be >= 0 and batch_size > 0"
            )
        self.drop_stale(current_version, max_staleness)
        self._groups = collections.deque(sorted(self._groups, key=self._oldest))  # (stable: FIFO among equals)
        n_groups, ready = self._prefix(batch_size)
        return n_groups if ready else None

    def waiting_at_most(self, version: int, skip: int = 0) -> int:
        """Samples waiting, past the first `skip` groups (in draw order), whose oldest token is <= `version`."""
        return sum(len(g) for i, g in enumerate(self._groups) if i >= skip and self._oldest(g) <= version)

    def take(self, n_groups: int, current_version: int) -> TrainBatch:
        """Pop the first `n_groups` groups (after `plan_batch`) as the batch for `current_version`."""
        groups = [self._groups.popleft() for _ in range(n_groups)]
        for g in groups:
            self._origin.pop(g[0].group_id, None)
        samples = [s for g in groups for s in g]
        self._waiting -= len(samples)
        self.counts.trained += len(samples)
        self.counts.batches += 1
        lags = [current_version - s.oldest_version for s in samples]
        self._last_staleness = (sum(lags) / len(lags), float(max(lags)))
        return TrainBatch(samples=samples, step=current_version, policy_version=current_version)

    # -- accounting and checkpoints -------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        c = self.counts
        return {
            "buffer/generated": float(c.generated),
            "buffer/trained": float(c.trained),
            "buffer/dropped_stale": float(c.dropped_stale),
            "buffer/dropped_invalid": float(c.dropped_invalid),
            "buffer/dropped_filtered": float(c.dropped_filtered),
            "buffer/dropped_failed": float(c.dropped_failed),
            "buffer/waiting": float(self._waiting),
            "buffer/waiting_groups": float(len(self._groups)),
            "buffer/invalid_samples": float(c.invalid_samples),
            "buffer/batches": float(c.batches),
            "buffer/staleness_mean": self._last_staleness[0],
            "buffer/staleness_max": self._last_staleness[1],
        }

    def state_dict(self) -> dict[str, Any]:
        """Plain python (msgspec/JSON/pickle-able), samples included; independent of live state."""
        return {
            "format": _FORMAT,
            "groups": [[msgspec.to_builtins(s) for s in g] for g in self._groups],
            "counts": dataclasses.asdict(self.counts),
            "last_staleness": list(self._last_staleness),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(f"not a replay buffer state (format {_FORMAT}): {str(state)[:80]}")
        try:
            groups = [[msgspec.convert(s, Sample) for s in g] for g in state["groups"]]
            counts = BufferCounts(**state["counts"])
            if not all(isinstance(v, int) and v >= 0 for v in dataclasses.asdict(counts).values()):
                raise ValueError(f"counts must be non-negative ints: {state['counts']}")
            mean, worst = (float(x) for x in state["last_staleness"])
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as err:
            raise ValueError(f"corrupt replay buffer state: {err}") from None
        if any(not g for g in groups):
            raise ValueError("corrupt replay buffer state: empty group")
        self._groups = collections.deque(groups)
        self._waiting = sum(len(g) for g in groups)
        self.counts = counts
        self._last_staleness = (mean, worst)
