"""Where each generated token's weight version comes from: the engine's own stamps, or the replica's ledger.

Owns: `VersionSource`, what the replica asks of it while generating (open / handed over / close a
request; the versions of the tokens an engine output added) and at a commit (the worker query
that runs in the apply's round trip, then moving the labels), and its two implementations:
`EngineStamps` (vLLM >= 0.32 stamps every token with the version that produced it: a finished
sequence carries spans, a running one is read from the frontend) and `LedgerVersions` (engines
without stamps: the replica's `VersionLedger`, moved at each commit to the token counts the
workers hold while paused).

Must never: move a label outside a commit, or read an engine's state other than through its driver (driver.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.generator.versions import VersionLedger, versions_from_spans, versions_from_starts
from asyncrl.interfaces import WorkerAPI

logger = logging.getLogger(__name__)

# versions(completion, begin, count) -> (versions of the `count` tokens from `begin`, the whole
# sequence's versions when the engine says them at the end, else None)
OutputVersions = Callable[[Any, int, int], tuple[list[int], list[int] | None]]


class VersionSource(Protocol):
    name: str  # "engine" or "ledger"
    counts_query: Callable[..., Any] | None  # the WorkerAPI verb the apply runs first, if any

    def open(self, engine_id: str, n: int, version: int) -> None: ...

    def handed_over(self, engine_id: str) -> None: ...

    def close(self, engine_id: str) -> None: ...

    def for_output(self, engine_id: str) -> OutputVersions:
        """The versions of the tokens one engine output of `engine_id` added, per completion."""

    async def counts(self, per_worker: list[Any] | None) -> dict[str, int] | None:
        """What the commit needs from the workers' answers to `counts_query` (read while paused)."""

    def mark(self, version: int, counts: dict[str, int] | None) -> None:
        """Move the labels to `version` at a commit; called with no await before the relabel."""


class EngineStamps:
    """The engine stamps each token (vLLM >= 0.32, `AsyncLLM.update_weight_version`)."""

    name = "engine"
    counts_query = None

    def __init__(self, engine: Any, counters: dict[str, Any], current_version: Callable[[], int]) -> None:
        self.engine, self.counters, self.current_version = engine, counters, current_version

    def open(self, engine_id: str, n: int, version: int) -> None:
        pass

    def handed_over(self, engine_id: str) -> None:
        pass

    def close(self, engine_id: str) -> None:
        pass

    def for_output(self, engine_id: str) -> OutputVersions:
        live: dict[int, list[tuple[str, int]]] | None = None

        def versions(completion: Any, begin: int, count: int) -> tuple[list[int], list[int] | None]:
            nonlocal live
            spans = getattr(completion, "weight_versions", None)
            if spans is not None:  # a finished sequence: the engine's own spans, authoritative
                final = versions_from_spans([(s.version, s.start, s.end) for s in spans], begin + count)
                return final[begin:], final
            if live is None:  # read once per engine output, for all its sequences
                live = self.engine.live_version_starts(engine_id)
            starts = live.get(completion.index)
            try:
                if starts:
                    return versions_from_starts(starts, begin, begin + count), None
            except ValueError:
                pass
            # Only reachable if vLLM's internals change shape; final spans still correct the result.
            self.counters["version_fallbacks"] += 1
            return [self.current_version()] * count, None

        return versions

    async def counts(self, per_worker: list[Any] | None) -> dict[str, int] | None:
        return None

    def mark(self, version: int, counts: dict[str, int] | None) -> None:
        pass  # the engine relabels itself (update_weight_version)


class LedgerVersions:
    """The replica's own ledger, for engines that do not stamp versions."""

    name = "ledger"

    def __init__(self, engine: Any, counters: dict[str, Any], replica_id: str) -> None:
        self.engine, self.counters, self.replica_id = engine, counters, replica_id
        # an instance attribute: a function in the class body would come back as a bound method
        self.counts_query: Callable[..., Any] | None = WorkerAPI.asyncrl_sampled_token_counts
        self.ledger = VersionLedger()

    def open(self, engine_id: str, n: int, version: int) -> None:
        self.ledger.open(engine_id, n, version)

    def handed_over(self, engine_id: str) -> None:
        self.ledger.handed_over(engine_id)

    def close(self, engine_id: str) -> None:
        self.ledger.close(engine_id)

    def for_output(self, engine_id: str) -> OutputVersions:
        def versions(completion: Any, begin: int, count: int) -> tuple[list[int], list[int] | None]:
            return self.ledger.versions(engine_id, completion.index, begin, count), None

        return versions

    async def counts(self, per_worker: list[Any] | None) -> dict[str, int] | None:
        """Tokens sampled so far per engine-internal sequence id, as the workers hold them
        (`asyncrl_sampled_token_counts` of each worker, read while paused)."""
        per_worker = per_worker or []
        if any(counts is None for counts in per_worker):
            # A model runner without per-request state: use what the frontend has processed, which
            # can trail the workers by the outputs still in the pipe (give those 20 ms to arrive).
            self.counters["version_fallbacks"] += 1
            await asyncio.sleep(0.02)
            return self.engine.frontend_token_counts()
        merged: dict[str, int] = {}
        for counts in per_worker:  # pipeline stages before the last may trail it: take the max
            for iid, n in counts.items():
                merged[iid] = max(merged.get(iid, 0), n)
        return merged

    def mark(self, version: int, counts: dict[str, int] | None) -> None:
        sampled = counts or {}
        for engine_id, n, handed_over in self.ledger.open_requests():
            by_index = self.engine.frontend_sequences(engine_id)
            handed_over = handed_over or bool(by_index)
            for index in range(n):
                iid = by_index.get(index)
                if iid is not None:
                    at = sampled.get(iid, 0)  # in the frontend, not in a worker: never scheduled
                elif not handed_over:
                    at = 0  # the engine has not seen it yet
                else:
                    continue  # finished before the pause: every token it has is older
                try:
                    self.ledger.mark(engine_id, index, version, at)
                except ValueError as err:
                    # A count that went backwards (engine internals changed shape). The weights
                    # are already loaded, so the commit stands; this sequence keeps its older label,
                    # which overstates staleness rather than hiding it.
                    self.counters["version_fallbacks"] += 1
                    logger.warning("replica %s: %s; keeping the older label", self.replica_id, err)
