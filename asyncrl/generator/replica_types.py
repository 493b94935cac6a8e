"""The engine replica's states, errors and option values, shared by the replica's parts and its callers.

Owns: `ReplicaState` (serving lifecycle: starting -> catching_up -> ready <-> sleeping -> stopped),
`UpdateState` (weight update: idle -> staging -> committing -> idle), the errors a replica raises
to its callers, and the literal option types of pause and version tracking.

Must never: hold behaviour, or import vLLM.
"""

from __future__ import annotations

import enum
from typing import Literal

from asyncrl.types import Refusal

PauseMode = Literal["abort", "wait", "keep"]
VersionTracking = Literal["auto", "engine", "ledger"]
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's sleep allocation tags, in wake order


class ReplicaState(enum.Enum):
    STARTING = "starting"  # engine booting
    CATCHING_UP = "catching_up"  # late joiner loading the current weights; not healthy yet
    READY = "ready"
    SLEEPING = "sleeping"
    STOPPED = "stopped"


class UpdateState(enum.Enum):
    IDLE = "idle"
    STAGING = "staging"  # buckets arriving
    COMMITTING = "committing"  # fingerprint check + in-place load


class WeightUpdateError(RuntimeError):
    """A weight update step failed; the replica stays on its previous version. `refusal` says why
    when the step refused before touching the live weights (a typed reason that survives pickling)."""

    def __init__(self, message: str, refusal: Refusal | None = None, applying: bool = False) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.applying = applying  # failed while applying: possibly part applied, and left paused

    def __reduce__(self):
        return (WeightUpdateError, (str(self), self.refusal, self.applying))


class ReplicaNotReady(RuntimeError):
    """The replica cannot serve (starting, catching up, stopped, its engine dead): nothing was generated."""


def replica_unavailable(err: BaseException) -> bool:
    """Whether `err` (or what it wraps: Ray's `cause`, `__cause__`) says the replica that took the request was not
    serving, so the request may be sent again as it was."""
    seen = 0
    while err is not None and seen < 6:
        if isinstance(err, ReplicaNotReady):
            return True
        err, seen = getattr(err, "cause", None) or err.__cause__, seen + 1
    return False
