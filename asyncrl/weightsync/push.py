"""Push orchestration: publish one weight version to every engine replica, atomically.

Owns: the order of a push (load_bucket, staged and verified beside the live weights -> pause ->
commit_update(fingerprint) -> resume), the registry of versions (`VersionRegistry`), the host copy of the last live
version, per-push metrics. Atomicity (the replicas' contract, sources.py): a failure before the commit is aborted
everywhere (the version goes FAILED); a part-applied or ahead replica is restored from the host copy while paused, else
reported out of service. Every call is bounded by `timeout_s`, paused replicas are always resumed.
Must never: pack or unpack tensors (bucket.py, plan.py), know the transport's medium, or let a version go live that
some live replica did not commit. Details: docs/design/weightsync.md, "Push orchestration".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config import WeightsyncConfig
from asyncrl.types import CommitReport, Refusal, UpdateBegin, WeightUpdateState, WeightVersion, refusal_of
from asyncrl.weightsync.sources import BucketSource, PushMetrics, ReplicaClient, Step, StepFailed, StreamedSource, refusals_of
from asyncrl.weightsync.transport import Channel

log = logging.getLogger(__name__)

S = WeightUpdateState


class WeightsyncError(RuntimeError):
    """A push failed. Names the step and the replica(s); the version is FAILED, not live."""

    def __init__(self, message: str, *, version: int, step: Step, replicas: Sequence[str] = (),
                 out_of_service: Sequence[str] = (), metrics: dict[str, float] | None = None,
                 refusals: dict[str, Refusal] | None = None) -> None:
        super().__init__(message)
        self.version, self.step = version, step
        self.replicas, self.out_of_service = list(replicas), list(out_of_service)
        self.metrics = metrics or {}
        self.refusals = dict(refusals or {})  # replica client -> why it refused, where it did


@dataclass
class PushResult:
    fingerprint: str
    metrics: dict[str, float]
    warnings: list[str] = field(default_factory=list)


# The one place transitions are defined (a push that failed is a FAILED record; pushing it again begins a new one).
_TRANSITIONS: dict[WeightUpdateState, frozenset[WeightUpdateState]] = {
    S.IDLE: frozenset({S.STAGING, S.FAILED}),
    S.STAGING: frozenset({S.COMMITTING, S.FAILED}),
    S.COMMITTING: frozenset({S.LIVE, S.FAILED}),
    S.LIVE: frozenset(),
    S.FAILED: frozenset(),
}


class RegistryError(RuntimeError):
    """An illegal registry operation (bad transition, version not newer, replica missing)."""


class VersionRegistry:
    """The publisher's in-process registry (no lock: only the trainer's event loop calls it). Keeps the records of the
    last `history` versions and always the live one's: a record per push, for days of pushes, would grow unbounded."""

    def __init__(self, initial_version: int = 0, history: int = 256) -> None:
        self.history = history
        self._records: dict[int, WeightVersion] = {}
        self._timeline: dict[int, list[tuple[str, float]]] = {}
        self._live: int = initial_version
        self._in_flight: int | None = None

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

    def timeline(self, version: int) -> list[tuple[str, float]]:
        """(state value, unix time) for every state the version entered, in order."""
        self.get(version)
        return list(self._timeline[version])

    def begin(self, version: int) -> WeightVersion:
        """Register `version` (IDLE) for a push; a version number that FAILED before may be pushed again."""
        if self._in_flight is not None:
            raise RegistryError(f"version {self._in_flight} is still being pushed; cannot begin {version}")
        if version <= self._live:
            raise RegistryError(f"version {version} is not newer than the live version {self._live}")
        old = self._records.get(version)
        if old is not None and old.state is not S.FAILED:
            raise RegistryError(f"version {version} already registered in state {old.state.value}")
        record = WeightVersion(version=version)
        self._records[version] = record
        self._timeline[version] = [(S.IDLE.value, record.created_at)]
        self._in_flight = version
        stale = [v for v in sorted(self._records) if v not in (self._live, version)]
        for v in stale[: max(0, len(self._records) - self.history)]:
            del self._records[v], self._timeline[v]
        return record

    def transition(self, version: int, new: WeightUpdateState, *, error: str | None = None) -> WeightVersion:
        record = self.get(version)
        if new not in _TRANSITIONS[record.state]:
            raise RegistryError(f"version {version}: illegal transition {record.state.value} -> {new.value}")
        if new is S.LIVE:
            raise RegistryError("LIVE is entered only through go_live(), which checks every replica committed")
        record.state = new
        if new is S.FAILED:
            record.error = error or "unknown error"
            self._in_flight = None
        self._timeline[version].append((new.value, time.time()))
        return record

    def replica_committed(self, version: int, replica: str) -> None:
        record = self.get(version)
        if record.state is not S.COMMITTING:
            raise RegistryError(f"replica {replica} committed version {version} in state {record.state.value}")
        if replica not in record.replicas:
            record.replicas.append(replica)

    def go_live(self, version: int, live_replicas: Iterable[str]) -> WeightVersion:
        """COMMITTING -> LIVE, only if every replica in `live_replicas` committed `version`."""
        record = self.get(version)
        if record.state is not S.COMMITTING:
            raise RegistryError(f"version {version}: illegal transition {record.state.value} -> live")
        missing = sorted(set(live_replicas) - set(record.replicas))
        if missing:
            raise RegistryError(f"version {version} cannot go live: replicas {missing} have not committed it")
        now = time.time()
        record.state, record.committed_at = S.LIVE, now
        self._timeline[version].append((S.LIVE.value, now))
        self._live, self._in_flight = version, None
        return record


class Pusher:
    """The atomic push of one source (`WeightPublisher`, service.py, the run's one publisher, calls it; tests and
    benchmarks, with sources of their own). One at a time (the registry refuses a second). `on_live(version, fingerprint,
    buckets)` gets each live version's buckets, or their handles where they are ObjectRefs (`by_reference`)."""

    def __init__(self, config: WeightsyncConfig, *, transport: Channel, registry: VersionRegistry | None = None,
                 on_live: Callable[[int, str, list[Any]], Awaitable[Any]] | None = None) -> None:
        self._cfg, self._transport = config, transport
        self.registry = registry if registry is not None else VersionRegistry()
        self._on_live = on_live
        self._host: BucketSource | StreamedSource | None = None  # the last live version's, its `version` set
        self._tail: asyncio.Future | None = None  # the last live version's host copy, being kept
        self.totals = {k: 0 for k in ("pushes_total", "pushes_failed_total", "rollbacks_total", "out_of_service_total")}

    def seed(self, source: BucketSource) -> None:
        """Keep the weights the replicas serve (the live version) as the host copy a failed first push restores."""
        source.version, self._host = self.registry.live_version, source

    async def push(self, version: int, source: BucketSource | StreamedSource, replicas: Sequence[ReplicaClient]) -> PushResult:
        """Push `source` as `version` to every replica."""
        m = PushMetrics(version, self._transport.name, len(replicas))
        tail_warnings = await self._settled(m)
        m.layout = source.layout
        self.registry.begin(version)
        self.totals["pushes_total"] += 1
        try:
            self.registry.transition(version, S.STAGING)
            try:
                fingerprint = await self._attempt(version, source, list(replicas), m)
            except StepFailed as f:
                raise self._fail(version, f, m) from next(iter(f.failures.values()), None)
        except BaseException as exc:
            source.discard()
            if self.registry.in_flight == version:  # cancelled, or a bug: never leave it in flight
                self.registry.transition(version, S.FAILED, error=f"{type(exc).__name__}: {exc}")
                m.failed = True
                self._finish(m, version)
            raise
        keeping = self._keep_live(version, fingerprint, source)
        if isinstance(source, StreamedSource):  # its host copy is made from now on: keep it in the background
            self._tail, warnings = asyncio.ensure_future(keeping), []
        else:
            report, warnings = await keeping
            _report_keep(m, report)
        return PushResult(fingerprint, self._finish(m, version), tail_warnings + warnings)

    async def _attempt(self, version: int, source: BucketSource | StreamedSource, replicas: list[ReplicaClient], m: PushMetrics) -> str:
        paused: float | None = None  # when the pause went out (None: not sent)
        begin = UpdateBegin(source.verify, source.layout, source.plan_id)
        try:
            t = time.perf_counter()
            await source.stream(self._step, version, replicas, m, begin)
            m.stage_seconds += time.perf_counter() - t
            fingerprint = source.fingerprint()  # (its digests are known once `stream` returned)
            record = self.registry.transition(version, S.COMMITTING)
            record.fingerprint, record.num_bytes, record.num_tensors = fingerprint, m.bytes, m.num_tensors
            if sum(r.fanout for r in replicas) != 1:  # (one engine replica's commit pauses, applies and resumes itself)
                paused = time.perf_counter()
                await self._step(Step.PAUSE, replicas, lambda r: r.pause("keep"), m)
            t = time.perf_counter()
            ok, bad = await self._run(Step.COMMIT, replicas, lambda r: self._commit(r, version, fingerprint, m), m)
            m.commit_seconds += time.perf_counter() - t
            for name in ok:
                self.registry.replica_committed(version, name)
            if bad:
                # Committed peers are ahead of the failed ones, and a non-verify commit failure
                # may be half applied: all of them go back to the last live version.
                restore = ok + [n for n, e in bad.items() if refusal_of(e) is not Refusal.VERIFY_FAILED]
                raise StepFailed(Step.COMMIT, bad, restore=restore)
            self.registry.go_live(version, [r.name for r in replicas])
            return fingerprint
        except StepFailed as f:  # every replica, its update begun or not: abort_update is idempotent
            await self._run(Step.ABORT, replicas, lambda r: r.abort_update(), m)
            if f.restore:
                f.out_of_service = await self._restore([r for r in replicas if r.name in f.restore], m)
            raise
        finally:
            if paused is not None or m.failed_commit:  # a failed apply under the commit's own pause leaves it paused
                await self._run(Step.RESUME, replicas, lambda r: r.resume(), m)
            if paused is not None:
                m.paused_seconds += time.perf_counter() - paused

    @staticmethod
    async def _commit(r: ReplicaClient, version: int, fingerprint: str, m: PushMetrics) -> None:
        """One replica's commit; records the apply path and seconds its `CommitReport`(s) name."""
        try:
            out = await r.commit_update(version, fingerprint)
        except BaseException:
            m.failed_commit = True
            raise
        for row in [x for x in (out.values() if isinstance(out, dict) else [out]) if isinstance(x, CommitReport)]:
            for step, seconds in row.seconds.items():
                m.replica_time(row.replica_id, step, seconds)
            m.paths.add(row.path)
            m.own_paused = max(m.own_paused, row.seconds.get("paused", 0.0))

    async def _run(self, step: Step, replicas: Sequence[ReplicaClient], call: Callable[[ReplicaClient], Awaitable[Any]],
                   m: PushMetrics) -> tuple[list[str], dict[str, BaseException]]:
        """Call `step` on every replica concurrently, each bounded by timeout_s. Never raises."""
        timeout = self._cfg.timeout_s

        async def one(r: ReplicaClient) -> tuple[str, BaseException | None]:
            t = time.perf_counter()
            try:
                await asyncio.wait_for(call(r), timeout)
                return r.name, None
            except (asyncio.TimeoutError, TimeoutError):
                return r.name, TimeoutError(f"{step.value} on replica {r.name} timed out after {timeout}s")
            except Exception as exc:
                return r.name, exc
            finally:
                m.replica_time(r.name, step.value, time.perf_counter() - t)

        results = await asyncio.gather(*(one(r) for r in replicas))
        return [n for n, e in results if e is None], {n: e for n, e in results if e is not None}

    async def _step(self, step: Step, replicas: Sequence[ReplicaClient], call: Callable[[ReplicaClient], Awaitable[Any]],
                    m: PushMetrics) -> None:
        _, bad = await self._run(step, replicas, call, m)
        if bad:
            raise StepFailed(step, bad)

    async def _restore(self, replicas: list[ReplicaClient], m: PushMetrics) -> list[str]:
        host, failed = self._host, [r.name for r in replicas]
        if host is not None:
            async def reload(r: ReplicaClient) -> None:
                begin = UpdateBegin(host.verify, host.layout, host.plan_id)
                await r.load_bucket([self._transport.payload(h) for h in host.handles], host.version, begin)
                await r.commit_update(host.version, host.fingerprint())

            ok, bad = await self._run(Step.RESTORE, replicas, reload, m)
            failed = list(bad)
            m.rollbacks += len(ok)
            self.totals["rollbacks_total"] += len(ok)
        m.out_of_service += len(failed)
        self.totals["out_of_service_total"] += len(failed)
        return failed

    def _fail(self, version: int, f: StepFailed, m: PushMetrics) -> WeightsyncError:
        detail = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in f.failures.items())
        message = f"weight push of version {version} failed at step {f.step.value} on replica(s) {sorted(f.failures)}: {detail}"
        if f.out_of_service:
            message += f"; out of service (need restart): {f.out_of_service}"
        self.registry.transition(version, S.FAILED, error=message)
        m.failed = True
        self.totals["pushes_failed_total"] += 1
        refusals = refusals_of(f.failures)
        return WeightsyncError(message, version=version, step=f.step, replicas=sorted(f.failures),
                               out_of_service=f.out_of_service, metrics=self._finish(m, version), refusals=refusals)

    async def _keep_live(self, version: int, fingerprint: str, source: BucketSource | StreamedSource) -> tuple[dict[str, float], list[str]]:
        """Make `version`'s host copy the one restores use, then run `on_live`. Never raises:
        returns its seconds and its warnings (a live version without a host copy or a store)."""
        t = time.perf_counter()
        report: dict[str, float] = {}
        warnings: list[str] = []
        kept = None
        try:
            report.update({f"thread_{k}": v for k, v in (await source.settle(self._cfg.timeout_s)).items()})
            kept, source.version = source, version
        except Exception as exc:  # live everywhere, but nothing to restore from or hand to late joiners
            report["store_failed"] = 1.0
            warnings.append(f"version {version} is live, but the sender's host copies failed ({type(exc).__name__}: {exc}): "
                            "no host copy is kept until the next push (a failed push cannot roll back; late joiners load the last "
                            "stored version)")
        report["kept"] = time.perf_counter() - t
        old, self._host = self._host, kept
        for h in old.handles if old is not None else []:
            with contextlib.suppress(Exception):
                self._transport.release(h)
        if kept is not None and self._on_live is not None:
            t = time.perf_counter()
            try:
                by_ref = self._transport.by_reference
                buckets = list(source.handles) if by_ref else [self._transport.fetch(h) for h in source.handles]
                await asyncio.wait_for(self._on_live(version, fingerprint, buckets), self._cfg.timeout_s)
            except Exception as exc:  # the version is live on every replica; only late joiners lag
                report["store_failed"] = 1.0
                warnings.append(f"on_live hook failed for version {version}: {type(exc).__name__}: {exc}")
            report["on_live"] = time.perf_counter() - t
        return report, warnings

    async def _settled(self, m: PushMetrics) -> list[str]:
        """Wait for the last live version's host copy (the tail) before anything reads it: its seconds go into `m`,
        its warnings are returned."""
        tail, self._tail = self._tail, None
        if tail is None:
            return []
        t = time.perf_counter()
        report, warnings = await tail
        m.host_copy_wait_seconds = time.perf_counter() - t
        _report_keep(m, report)
        return warnings

    async def drain(self) -> tuple[dict[str, float], list[str]]:
        """Wait for the last live version's host copy: the metrics a next push would report for it, and warnings."""
        m = PushMetrics(self.registry.live_version, self._transport.name, 0)
        warnings = await self._settled(m)
        tail = {"host_copy_seconds", "host_copy_wait_seconds", "on_live_seconds", "store_failed"}
        metrics = {k: v for k, v in m.as_dict().items() if k.removeprefix("weightsync/") in tail or "/host_copy_thread_" in k}
        return metrics, warnings

    def _finish(self, m: PushMetrics, version: int) -> dict[str, float]:
        m.finish()
        out = m.as_dict(self.registry.timeline(version))
        out.update({f"weightsync/{k}": float(v) for k, v in self.totals.items()})
        return out


def _report_keep(m: PushMetrics, report: dict[str, float]) -> None:
    """`Pusher._keep_live`'s seconds into `m` (a collective push's go into the next push's)."""
    m.host_copy_seconds = report.get("kept", 0.0)
    m.on_live_seconds, m.store_failed = report.get("on_live", 0.0), bool(report.get("store_failed"))
    m.sender_seconds.update({f"host_copy_{k}": v for k, v in report.items() if k.startswith("thread_")})
