"""Staleness admission control: may another rollout start now?

Owns: the counts of rollout slots by lifecycle state and the admission rule of docs/ARCHITECTURE.md: a rollout of n
samples may start only if admitted + running + n <= (eta + v + 1) * B (v the learner version, B the batch size, eta
the max staleness; `+ n <=`, as the strict per-sample form would overshoot by n - 1), so at most eta + 1 batches are
waiting or in flight. Slots go RUNNING -> ACCEPTED -> DROPPED, or RUNNING -> REJECTED (`_TRANSITIONS`); rejected
and stale-dropped slots are credited back (counting them would leak capacity until admission deadlocks), and the
bound uses admitted = accepted_total - dropped.
Invariant (checked by the tests at every step): admitted + running <= (eta + v + 1) * B.
Must never: hold samples, wait, or know about Ray; it is a pure counter, checked on every call.
Details: docs/design/buffer.md, "Staleness admission control".
"""

from __future__ import annotations

import enum
from typing import Any


class SlotState(enum.Enum):
    RUNNING = "running"  # reserved by a rollout that is still generating
    ACCEPTED = "accepted"  # entered the buffer (waiting or trained): counts against the bound
    REJECTED = "rejected"  # released before acceptance: never counted
    DROPPED = "dropped"  # accepted, later dropped stale: credited back


_NEW = None
_TRANSITIONS: frozenset[tuple[SlotState | None, SlotState]] = frozenset(
    {
        (_NEW, SlotState.RUNNING),
        (SlotState.RUNNING, SlotState.ACCEPTED),
        (SlotState.RUNNING, SlotState.REJECTED),
        (SlotState.ACCEPTED, SlotState.DROPPED),
    }
)
_STATE_KEYS = ("batch_size", "max_staleness", "version", "running", "accepted", "rejected", "dropped")


def _count(name: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if n < 0:
        raise ValueError(f"{name}={n} must be >= 0")
    return n


class StalenessManager:
    """Counts rollout slots by state and decides admission. Not thread-safe: one owner calls it."""

    def __init__(self, batch_size: int, max_staleness: int, version: int = 0) -> None:
        if _count("batch_size", batch_size) == 0:
            raise ValueError("batch_size=0 must be > 0")
        self.batch_size = batch_size
        self.max_staleness = _count("max_staleness", max_staleness)
        self.version = _count("version", version)
        self._counts: dict[SlotState, int] = {s: 0 for s in SlotState}

    # -- the rule -------------------------------------------------------------------------------
    @property
    def running(self) -> int:
        return self._counts[SlotState.RUNNING]

    @property
    def admitted(self) -> int:
        """Accepted samples that still count against the bound (trained + waiting)."""
        return self._counts[SlotState.ACCEPTED]

    @property
    def accepted_total(self) -> int:
        """Samples ever accepted into the buffer, including those later dropped stale."""
        return self._counts[SlotState.ACCEPTED] + self._counts[SlotState.DROPPED]

    def limit(self) -> int:
        """(eta + v + 1) * B: the most samples that may be admitted or running at version v."""
        return (self.max_staleness + self.version + 1) * self.batch_size

    def capacity_left(self) -> int:
        """Samples that may still be reserved at the current version (never negative)."""
        return max(0, self.limit() - self.admitted - self.running)

    def can_acquire(self, n: int) -> bool:
        self._check_group(n)
        return self.admitted + self.running + n <= self.limit()

    def try_acquire(self, n: int) -> bool:
        """Reserve n running slots (one rollout of n samples) if the rule allows; else change nothing."""
        if not self.can_acquire(n):
            return False
        self._move(_NEW, SlotState.RUNNING, n)
        return True

    # -- transitions ----------------------------------------------------------------------------
    def on_accepted(self, n: int) -> None:
        """n running samples entered the buffer."""
        self._move(SlotState.RUNNING, SlotState.ACCEPTED, _count("n", n))

    def on_rejected(self, n: int) -> None:
        """n running samples will never enter the buffer (failed, aborted, invalid, filtered)."""
        self._move(SlotState.RUNNING, SlotState.REJECTED, _count("n", n))

    def on_dropped(self, n: int) -> None:
        """n accepted samples were dropped stale by the buffer; their slots are credited back."""
        self._move(SlotState.ACCEPTED, SlotState.DROPPED, _count("n", n))

    def set_version(self, version: int) -> None:
        """The learner reached `version`; versions never go back."""
        _count("version", version)
        if version < self.version:
            raise ValueError(f"version {version} is older than the current version {self.version}")
        self.version = version

    def _check_group(self, n: int) -> None:
        if _count("n", n) == 0:
            raise ValueError("n=0: a rollout reserves at least one sample")
        if n > self.batch_size:
            # A group larger than a batch could never be trained whole.
            raise ValueError(f"n={n} exceeds batch_size={self.batch_size}")

    def _move(self, src: SlotState | None, dst: SlotState, n: int) -> None:
        if (src, dst) not in _TRANSITIONS:
            raise ValueError(f"illegal slot transition {src} -> {dst}")
        if src is not None:
            if n > self._counts[src]:
                raise ValueError(
                    f"cannot move {n} slots {src.value} -> {dst.value}: only {self._counts[src]} are {src.value}"
                )
            self._counts[src] -= n
        self._counts[dst] += n

    # -- checkpoint -----------------------------------------------------------------------------
    def state(self) -> dict[str, int]:
        return {
            "batch_size": self.batch_size,
            "max_staleness": self.max_staleness,
            "version": self.version,
            "running": self._counts[SlotState.RUNNING],
            "accepted": self._counts[SlotState.ACCEPTED],
            "rejected": self._counts[SlotState.REJECTED],
            "dropped": self._counts[SlotState.DROPPED],
        }

    def load_state(self, state: dict[str, int]) -> None:
        """Restore counters. `batch_size` must match (counters are in units of it); eta may change."""
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"staleness state must have keys {sorted(_STATE_KEYS)}, got {got}")
        values = {k: _count(f"state[{k!r}]", state[k]) for k in _STATE_KEYS}
        if values["batch_size"] != self.batch_size:
            raise ValueError(
                f"checkpoint batch_size={values['batch_size']} differs from configured batch_size={self.batch_size}"
            )
        self.version = values["version"]
        for s in SlotState:
            self._counts[s] = values[s.value]

    def metrics(self) -> dict[str, float]:
        return {
            "buffer/version": float(self.version),
            "buffer/running": float(self.running),
            "buffer/accepted": float(self.accepted_total),
            "buffer/admitted": float(self.admitted),
            "buffer/rejected": float(self._counts[SlotState.REJECTED]),
            "buffer/admission_left": float(self.capacity_left()),
        }
