"""The weight-version registry: which version is live, and how each push went.

Owns: a `WeightVersion` record for each of the last `history` pushed versions and its lifecycle (IDLE -> STAGING -> COMMITTING -> LIVE | FAILED,
every transition in `_TRANSITIONS`), each version's timeline (a timestamp per state entered), which replica serves
which version, and the rule that a version becomes LIVE only when every live replica committed it (the publisher's
own, in the trainer's process: no other process reads it).
Not the late-joiner weights: those bytes live in the generator's `WeightStore` actor, which weightsync publishes to
only after a version went LIVE here. This registry owns the state, the store owns the bytes.
Must never: move tensors, talk to replicas, or let a FAILED version become live.
Details: docs/design/weightsync.md, "The weight-version registry".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from asyncrl.types import WeightUpdateState, WeightVersion

S = WeightUpdateState

# The one place transitions are defined. COMMITTING -> STAGING is a retry that restages from
# scratch after a failed commit (the engines dropped their staged copy).
_TRANSITIONS: dict[WeightUpdateState, frozenset[WeightUpdateState]] = {
    S.IDLE: frozenset({S.STAGING, S.FAILED}),
    S.STAGING: frozenset({S.STAGING, S.COMMITTING, S.FAILED}),
    S.COMMITTING: frozenset({S.STAGING, S.LIVE, S.FAILED}),
    S.LIVE: frozenset(),
    S.FAILED: frozenset(),
}


class RegistryError(RuntimeError):
    """An illegal registry operation (bad transition, version not newer, replica missing)."""


class VersionRegistry:
    """Plain, in-process registry. Thread-safe so one instance can back a threaded Ray actor. It keeps the
    records of the last `history` versions pushed (and always the live one's): a run pushes once a step, for
    days, and a record per push would grow the trainer's memory and every `snapshot` without bound."""

    def __init__(self, initial_version: int = 0, history: int = 256) -> None:
        if history < 1:
            raise ValueError(f"history={history} must be >= 1")
        self.history = history
        self._lock = threading.Lock()
        self._records: dict[int, WeightVersion] = {}
        self._timeline: dict[int, list[tuple[str, float]]] = {}
        self._live: int = initial_version
        self._in_flight: int | None = None
        self._replica_versions: dict[str, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def live_version(self) -> int:
        return self._live

    @property
    def in_flight(self) -> int | None:
        return self._in_flight

    def get(self, version: int) -> WeightVersion:
        try:
            return self._records[version]
        except KeyError:
            raise RegistryError(f"version {version} is not registered") from None

    def records(self) -> list[WeightVersion]:
        return [self._records[v] for v in sorted(self._records)]

    def timeline(self, version: int) -> list[tuple[str, float]]:
        """(state value, unix time) for every state the version entered, in order."""
        self.get(version)
        return list(self._timeline[version])

    def replica_versions(self) -> dict[str, int]:
        return dict(self._replica_versions)

    # ---- lifecycle -----------------------------------------------------------------------
    def begin(self, version: int, *, num_bytes: int = 0, num_tensors: int = 0) -> WeightVersion:
        """Register `version` (IDLE) for a push. It must be newer than the live one and no
        other push may be in flight. A version number that FAILED before may be pushed again."""
        with self._lock:
            if not isinstance(version, int) or isinstance(version, bool):
                raise RegistryError(f"version={version!r} must be an int")
            if self._in_flight is not None:
                raise RegistryError(f"version {self._in_flight} is still being pushed; cannot begin {version}")
            if version <= self._live:
                raise RegistryError(f"version {version} is not newer than the live version {self._live}")
            old = self._records.get(version)
            if old is not None and old.state is not S.FAILED:
                raise RegistryError(f"version {version} already registered in state {old.state.value}")
            record = WeightVersion(version=version, num_bytes=num_bytes, num_tensors=num_tensors)
            self._records[version] = record
            self._timeline[version] = [(S.IDLE.value, record.created_at)]
            self._in_flight = version
            stale = [v for v in sorted(self._records) if v not in (self._live, version)]
            for v in stale[: max(0, len(self._records) - self.history)]:
                del self._records[v], self._timeline[v]
            return record

    def transition(self, version: int, new: WeightUpdateState, *, error: str | None = None) -> WeightVersion:
        with self._lock:
            return self._transition(version, new, error=error)

    def _transition(self, version: int, new: WeightUpdateState, *, error: str | None = None) -> WeightVersion:
        record = self.get(version)
        if new not in _TRANSITIONS[record.state]:
            raise RegistryError(f"version {version}: illegal transition {record.state.value} -> {new.value}")
        if new is S.LIVE:
            raise RegistryError("LIVE is entered only through go_live(), which checks every replica committed")
        record.state = new
        if new is S.STAGING:
            record.replicas = []  # a retry restages every replica from scratch
        if new is S.FAILED:
            record.error = error or "unknown error"
            self._in_flight = None
        self._timeline[version].append((new.value, time.time()))
        return record

    def set_payload(self, version: int, *, fingerprint: str, num_bytes: int, num_tensors: int) -> None:
        with self._lock:
            record = self.get(version)
            record.fingerprint, record.num_bytes, record.num_tensors = fingerprint, num_bytes, num_tensors

    def replica_committed(self, version: int, replica: str) -> None:
        with self._lock:
            record = self.get(version)
            if record.state is not S.COMMITTING:
                raise RegistryError(f"replica {replica} committed version {version} in state {record.state.value}")
            if replica not in record.replicas:
                record.replicas.append(replica)

    def go_live(self, version: int, live_replicas: Iterable[str]) -> WeightVersion:
        """COMMITTING -> LIVE, only if every replica in `live_replicas` committed `version`."""
        with self._lock:
            record = self.get(version)
            if record.state is not S.COMMITTING:
                raise RegistryError(f"version {version}: illegal transition {record.state.value} -> live")
            expected = set(live_replicas)
            missing = sorted(expected - set(record.replicas))
            if missing:
                raise RegistryError(f"version {version} cannot go live: replicas {missing} have not committed it")
            now = time.time()
            record.state, record.committed_at = S.LIVE, now
            self._timeline[version].append((S.LIVE.value, now))
            self._live, self._in_flight = version, None
            for replica in expected:
                self._replica_versions[replica] = version
            return record

    def replica_loaded(self, replica: str, version: int) -> None:
        """A replica now serves `version` (late joiner loaded the store, or a rollback)."""
        with self._lock:
            record = self._records.get(version)
            if record is not None and record.state is not S.LIVE:
                raise RegistryError(f"replica {replica} cannot serve version {version}: it is {record.state.value}")
            self._replica_versions[replica] = version

    def replica_removed(self, replica: str) -> None:
        with self._lock:
            self._replica_versions.pop(replica, None)

    def snapshot(self) -> dict[str, Any]:
        """Everything a reader (admin route, controller, logger) wants, as plain data."""
        with self._lock:
            return {
                "live_version": self._live,
                "in_flight": self._in_flight,
                "replica_versions": dict(self._replica_versions),
                "versions": [{"version": r.version, "state": r.state.value, "fingerprint": r.fingerprint, "num_bytes": r.num_bytes,
                              "num_tensors": r.num_tensors, "replicas": list(r.replicas), "error": r.error,
                              "timeline": list(self._timeline[r.version])} for r in (self._records[v] for v in sorted(self._records))],
            }
