"""Push orchestration: publish one weight version to every engine replica, atomically.

Owns: the order of a push (for every replica, concurrently: pause("keep") -> begin_update ->
load_bucket* -> commit_update(fingerprint) -> resume; through a collective transport one
`load_bucket` per replica receives the sender's broadcast: `publish_streamed`), its atomicity,
timeouts and retries, the publisher's host copy of the last live version (its bucket handles),
and per-push metrics.

Atomicity, as designed with the generator's interface (replicas.py lists the contract):
- Staging never touches live weights, so any failure before commit (a bucket fails to load, a
  step times out, a replica dies) is undone by `abort_update` on every replica: they keep
  serving the last committed version. The version goes FAILED and is never live.
- The fingerprint (`tensor_fingerprint` over the HF-named full tensors, in the configured
  `verify` mode: full | sampled | off) is checked by each replica before it applies anything, so
  a corrupted bucket fails the commit cleanly. Both sides hash per tensor as buckets pass (the
  publisher right after a bucket's load is sent, the replica as it stages it), so verifying
  costs no pass of its own at commit.
- A commit that fails for any other reason may have applied part of the tensors; replicas that
  did commit the new version while a peer failed are ahead of it. Both kinds are restored
  while still paused: the last live version's buckets (kept in the object store by this
  publisher) are pushed again through begin/load/commit. A replica that cannot be restored (no
  host copy, or the restore itself fails) is reported out of service: it is dropped from the registry, the
  `on_out_of_service` hook runs (the controller restarts it; on start it loads the
  generator's WeightStore) and the error lists it.
- Every call is bounded by `timeout_s`; a failed attempt is retried `retries` times (restaged
  from scratch, buckets replayed from their handles, the tensor stream is read once);
  a dead replica or a failing tensor stream is not retried. Paused replicas are always resumed.

Collective pushes end when the version is live: the sender's host copy of it (what a later
restore pushes again, and what `on_live` hands to the WeightStore for late joiners) is still
being made then, and a background task (the "tail") collects it, swaps it in for the previous
version's and runs `on_live`. Everything that reads the host copy waits for the tail first: the
next push (before it pauses anyone; its sender reuses the pinned buffers too) and `load_live`.
The tail's warnings and seconds are reported with the next push.

`preserve_rng_state` wraps every publish because the tensor stream (the learner's export) is
consumed lazily inside it.

Must never: pack or unpack tensors itself (bucket.py), know the transport's medium
(transport.py), or let a version go live that some live replica did not commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.config import WeightsyncConfig
from asyncrl.generator.weights import VerifyMode, check_verify_mode, combine_digests, fingerprint_mode, tensor_digest
from asyncrl.types import WeightUpdateState
from asyncrl.weightsync.bucket import Bucket, iter_buckets, unpack_bucket
from asyncrl.weightsync.metrics import PushMetrics
from asyncrl.weightsync.registry import VersionRegistry
from asyncrl.weightsync.replicas import ReplicaClient, is_replica_dead, is_verify_failure
from asyncrl.weightsync.transport import Transport

S = WeightUpdateState
NamedTensorIter = Iterable[tuple[str, Any]]
OnLive = Callable[[int, str, list[Bucket]], Any]
OnOutOfService = Callable[[str, str], Any]


class Step(str, enum.Enum):
    EXPORT = "export"  # reading the tensor stream / packing
    PAUSE = "pause"
    BEGIN = "begin_update"
    LOAD = "load_bucket"
    FINGERPRINT = "fingerprint"
    COMMIT = "commit_update"
    ABORT = "abort_update"
    RESUME = "resume"
    RESTORE = "restore"


class WeightsyncError(RuntimeError):
    """A push failed. Names the step and the replica(s); the version is FAILED, not live."""

    def __init__(self, message: str, *, version: int, step: Step, replicas: Sequence[str] = (),
                 out_of_service: Sequence[str] = (), metrics: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.version, self.step = version, step
        self.replicas, self.out_of_service = list(replicas), list(out_of_service)
        self.metrics = metrics or {}

    @property
    def replica(self) -> str | None:
        return self.replicas[0] if self.replicas else None


class StepTimeout(TimeoutError):
    pass


@dataclass
class _StepFailed(Exception):
    step: Step
    failures: dict[str, BaseException]
    retryable: bool = True
    restore: list[str] = field(default_factory=list)  # replicas to put back on the last live version
    out_of_service: list[str] = field(default_factory=list)


@dataclass
class PushResult:
    version: int
    fingerprint: str
    replicas: list[str]
    metrics: dict[str, float]
    warnings: list[str] = field(default_factory=list)


@dataclass
class _HostCopy:
    """The last live version's buckets, held by their transport handles (not in this heap)."""

    version: int
    fingerprint: str
    handles: list[Any]


@contextlib.contextmanager
def preserve_rng_state() -> Iterator[None]:
    """Save torch's CPU (and, if initialised, CUDA) RNG state and restore it afterwards, so that
    exporting and moving weights never shifts the learner's random stream."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _BucketSource:
    """Packs the tensor stream lazily and puts each bucket once; a retry replays the handles.

    Each bucket is hashed (per tensor, in `verify` mode) when the consumer comes back for the
    next one, i.e. after it sent this bucket's load: the hashing overlaps the replicas' staging.
    That holds for buckets packed here and for handles put by someone else (`from_handles`)."""

    def __init__(self, named: NamedTensorIter, bucket_mb: float, transport: Transport, m: PushMetrics,
                 verify: VerifyMode = "full") -> None:
        self._buckets = iter_buckets(named, bucket_mb)
        self._transport, self._m = transport, m
        self.verify = check_verify_mode(verify)
        self.handles: list[Any] = []
        self.exhausted = False
        self._digests: dict[str, bytes] = {}
        self._hashed = 0  # buckets hashed so far, in handle order

    def _hash(self, bucket: Bucket) -> None:
        t = time.perf_counter()
        for name, tensor in unpack_bucket(bucket):
            self._digests[name] = tensor_digest(name, tensor, self.verify)
        self._hashed += 1
        self._m.fingerprint_seconds += time.perf_counter() - t

    def __iter__(self) -> Iterator[Any]:
        for i, handle in enumerate(list(self.handles)):
            yield handle
            if i == self._hashed:  # not hashed yet: handed in, or an earlier attempt stopped first
                try:
                    bucket = self._transport.fetch(handle)
                except Exception as exc:
                    raise _StepFailed(Step.EXPORT, {"publisher": exc}, retryable=False) from exc
                self._hash(bucket)
        while not self.exhausted:
            try:
                bucket = next(self._buckets)
            except StopIteration:
                self.exhausted = True
                return
            except Exception as exc:  # the learner's export (or a bad tensor) failed: not retryable
                raise _StepFailed(Step.EXPORT, {"publisher": exc}, retryable=False) from exc
            t = time.perf_counter()
            handle = self._transport.put(bucket)
            self._m.put_seconds += time.perf_counter() - t
            self._m.bytes += bucket.payload_bytes
            self._m.num_tensors += len(bucket)
            self._m.num_buckets += 1
            self.handles.append(handle)
            yield handle
            self._hash(bucket)
            del bucket  # the transport holds it now; keep at most one packed bucket in this heap

    @classmethod
    def from_handles(cls, handles: Sequence[Any], transport: Transport, m: PushMetrics,
                     verify: VerifyMode = "full") -> "_BucketSource":
        """Buckets someone else already put (the learner ranks export straight into the
        transport): nothing to pack, the handles are replayed as they are. Each is read here for
        its size and names only; it is hashed as it streams."""
        source = cls((), 1.0, transport, m, verify)
        source.handles, source.exhausted = list(handles), True
        seen: set[str] = set()
        for h in source.handles:
            bucket = transport.fetch(h)
            names = bucket.names
            if seen.intersection(names) or len(set(names)) != len(names):
                raise ValueError(f"a tensor name appears twice across the {len(handles)} bucket handles")
            seen.update(names)
            m.bytes += bucket.payload_bytes
            m.num_tensors += len(bucket)
            m.num_buckets += 1
        return source

    def fingerprint(self) -> str:
        if not self.exhausted or self._hashed != len(self.handles):
            raise RuntimeError("fingerprint before the tensor stream was read to its end")
        return combine_digests(self._digests, self.verify)


@dataclass
class StreamedSend:
    """What a collective sender reports for one version (weightsync/collective.py): per-tensor
    digests, sizes, its phase seconds and its host copies in the transport (handles). A sender
    that makes them off the critical path gives `collect` instead, which returns them once made;
    the publisher awaits it while the replicas commit."""

    handles: list[Any]
    digests: dict[str, bytes]
    bytes: int
    num_tensors: int
    seconds: dict[str, float] = field(default_factory=dict)
    collect: Callable[[], Awaitable["KeptCopies"]] | None = None
    num_buckets: int | None = None  # None: len(handles)


@dataclass
class KeptCopies:
    """A sender's host copies once made (`StreamedSend.collect`): handles in bucket order, and the
    seconds its copy thread waited for device-to-host copies (`copy`) and spent keeping them (`keep`)."""

    handles: list[Any]
    seconds: dict[str, float] = field(default_factory=dict)


Send = Callable[[int, VerifyMode], Awaitable[StreamedSend]]


class _StreamedSource:
    """A collective push: the sender broadcasts every bucket while each replica's single
    `load_bucket(payload)` receives them; no bucket passes through the publisher. The sender's
    host copies become the handles (restores, late joiners) and its digests the fingerprint.
    Each attempt runs `prepare` (form or check the broadcast group) and sends afresh."""

    def __init__(self, send: Send, payload: Callable[[int], Any], prepare: Callable[[], Awaitable[Any]] | None,
                 verify: VerifyMode = "full") -> None:
        self._send, self._payload, self._prepare = send, payload, prepare
        self.verify = check_verify_mode(verify)
        self.handles: list[Any] = []
        self._digests: dict[str, bytes] | None = None
        self._collecting: asyncio.Future | None = None

    async def stream(self, publisher: "Publisher", version: int, replicas: list[ReplicaClient], m: PushMetrics) -> None:
        self.discard(publisher._transport)  # an earlier attempt's host copies
        self.handles, self._digests = [], None
        if self._prepare is not None:
            try:
                await asyncio.wait_for(self._prepare(), publisher._cfg.timeout_s)
            except Exception as exc:
                raise _StepFailed(Step.LOAD, {"broadcast group": exc}) from exc
        payload = self._payload(version)
        receiving = asyncio.ensure_future(publisher._step(Step.LOAD, replicas, lambda r: r.load_bucket(payload, version), m))
        try:
            sent = await asyncio.wait_for(self._send(version, self.verify), publisher._cfg.timeout_s)
        except Exception as exc:
            # The sender told the receivers (abort header), or they give up at their deadline.
            with contextlib.suppress(BaseException):
                await receiving
            raise _StepFailed(Step.EXPORT, {"publisher": exc}) from exc
        except BaseException:
            receiving.cancel()
            raise
        if sent.collect is not None:  # the host copies are made while the replicas finish and commit
            self._collecting = asyncio.ensure_future(sent.collect())
        await receiving
        self.handles, self._digests = list(sent.handles), dict(sent.digests)
        m.bytes, m.num_tensors = sent.bytes, sent.num_tensors
        m.num_buckets = len(sent.handles) if sent.num_buckets is None else sent.num_buckets
        m.put_seconds = sent.seconds.get("broadcast", 0.0)
        m.fingerprint_seconds = sent.seconds.get("hash", 0.0)
        m.sender_seconds.update(sent.seconds)

    def fingerprint(self) -> str:
        if self._digests is None:
            raise RuntimeError("fingerprint before the sender finished")
        return combine_digests(self._digests, self.verify)

    async def settle(self, timeout_s: float) -> dict[str, float]:
        """Wait for the sender's host copies (they become `handles`); returns the copy thread's seconds."""
        collecting, self._collecting = self._collecting, None
        if collecting is None:
            return {}
        kept = await asyncio.wait_for(collecting, timeout_s)
        self.handles = list(kept.handles)
        return dict(kept.seconds)

    def discard(self, transport: Transport) -> None:
        """Release host copies still being collected once they arrive (a failed or retried attempt)."""
        collecting, self._collecting = self._collecting, None
        if collecting is None:
            return

        def release(done: asyncio.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            for h in done.result().handles:
                with contextlib.suppress(Exception):
                    transport.release(h)

        collecting.add_done_callback(release)


class Publisher:
    """Pushes versions to replicas. One push at a time (the registry refuses a second)."""

    def __init__(self, config: WeightsyncConfig, *, transport: Transport, registry: VersionRegistry | None = None,
                 mirror: Callable[..., Any] | None = None, on_live: OnLive | None = None,
                 on_out_of_service: OnOutOfService | None = None, preserve_rng: bool = True) -> None:
        self._cfg, self._transport = config, transport
        self.registry = registry if registry is not None else VersionRegistry()
        self._mirror, self._on_live, self._on_oos = mirror, on_live, on_out_of_service
        self._preserve_rng = preserve_rng
        self._host: _HostCopy | None = None
        self._tail: asyncio.Future | None = None  # the last live version's host copy, being kept
        self.last_metrics: dict[str, float] = {}
        self.totals = {k: 0 for k in ("pushes_total", "pushes_failed_total", "retries_total", "rollbacks_total", "out_of_service_total")}

    # ---- registry (local, mirrored to the service actor for readers) ---------------------
    def _reg(self, op: str, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self.registry, op)(*args, **kwargs)
        if self._mirror is not None:
            with contextlib.suppress(Exception):  # readers' view is best effort; the push is not
                self._mirror(op, *args, **kwargs)
        return out

    @property
    def host_version(self) -> int | None:
        return self._host.version if self._host else None

    def seed(self, version: int, named_tensors: NamedTensorIter) -> str:
        """Keep a host copy of weights the replicas already serve (e.g. loaded from disk at
        start), so a failed first push can still restore them. Returns their fingerprint."""
        if version != self.registry.live_version:
            raise ValueError(f"seed version {version} is not the registry's live version {self.registry.live_version}")
        source = _BucketSource(named_tensors, self._cfg.bucket_mb, self._transport,
                               PushMetrics(version, self._transport.name, 0), self._cfg.verify)
        try:
            for _ in source:
                pass
        except _StepFailed as f:
            raise f.failures["publisher"] from None
        self._host = _HostCopy(version, source.fingerprint(), source.handles)
        return self._host.fingerprint

    # ---- one push ------------------------------------------------------------------------
    async def publish(self, version: int, named_tensors: NamedTensorIter, replicas: Sequence[ReplicaClient]) -> PushResult:
        rng = preserve_rng_state() if self._preserve_rng else contextlib.nullcontext()
        with rng:
            return await self._publish(version, named_tensors, list(replicas))

    async def publish_handles(self, version: int, handles: Sequence[Any], replicas: Sequence[ReplicaClient]) -> PushResult:
        """`publish` for buckets already in the transport (e.g. `LearnerGroup.export_hf_tensors_packed`)."""
        rng = preserve_rng_state() if self._preserve_rng else contextlib.nullcontext()
        with rng:
            return await self._publish(version, None, list(replicas), handles=list(handles))

    async def publish_streamed(self, version: int, send: Send, payload: Callable[[int], Any],
                               replicas: Sequence[ReplicaClient], prepare: Callable[[], Awaitable[Any]] | None = None) -> PushResult:
        """`publish` through a collective transport: `send(version, verify)` broadcasts the
        weights (and returns a `StreamedSend`) while every replica's `load_bucket(payload(version))`
        receives them; `prepare()` runs before each attempt (e.g. forms the broadcast group)."""
        rng = preserve_rng_state() if self._preserve_rng else contextlib.nullcontext()
        with rng:
            source = _StreamedSource(send, payload, prepare, self._cfg.verify)
            return await self._publish(version, None, list(replicas), source=source)

    async def _publish(self, version: int, named: NamedTensorIter | None, replicas: list[ReplicaClient],
                       handles: list[Any] | None = None, source: "_BucketSource | _StreamedSource | None" = None) -> PushResult:
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be unique, got {names}")
        m = PushMetrics(version, self._transport.name, len(replicas))
        tail_warnings = await self._settled(m)
        if handles is not None:  # read before registering: a bad handle leaves nothing in flight
            source = _BucketSource.from_handles(handles, self._transport, m, self._cfg.verify)
        elif source is None:
            source = _BucketSource(named, self._cfg.bucket_mb, self._transport, m, self._cfg.verify)
        self._reg("begin", version)
        self.totals["pushes_total"] += 1
        try:
            for attempt in range(self._cfg.retries + 1):
                m.attempts = attempt + 1
                self._reg("transition", version, S.STAGING)
                try:
                    fingerprint = await self._attempt(version, source, replicas, m)
                    break
                except _StepFailed as f:
                    if not f.retryable or attempt == self._cfg.retries or f.out_of_service:
                        raise self._fail(version, f, m) from next(iter(f.failures.values()), None)
                    m.retries += 1
                    self.totals["retries_total"] += 1
        except BaseException as exc:
            for h in source.handles:  # the failed version's buckets: nobody will read them again
                with contextlib.suppress(Exception):
                    self._transport.release(h)
            if isinstance(source, _StreamedSource):
                source.discard(self._transport)
            if self.registry.in_flight == version:  # cancelled, or a bug: never leave it in flight
                self._reg("transition", version, S.FAILED, error=f"{type(exc).__name__}: {exc}")
                m.failed = True
                self._finish(m, version)
            raise
        warnings = await self._went_live(version, fingerprint, source, m)
        return PushResult(version, fingerprint, names, self._finish(m, version), tail_warnings + warnings)

    async def _attempt(self, version: int, source: "_BucketSource | _StreamedSource", replicas: list[ReplicaClient], m: PushMetrics) -> str:
        pause_sent = begin_sent = False
        try:
            pause_sent, paused = True, time.perf_counter()
            await self._step(Step.PAUSE, replicas, lambda r: r.pause("keep"), m)
            begin_sent = True
            await self._step(Step.BEGIN, replicas, lambda r: r.begin_update(version, source.verify), m)
            t = time.perf_counter()
            if isinstance(source, _StreamedSource):
                await source.stream(self, version, replicas, m)
            else:
                await self._stream(version, source, replicas, m)
            m.stage_seconds += time.perf_counter() - t
            try:
                fingerprint = source.fingerprint()
            except Exception as exc:
                raise _StepFailed(Step.FINGERPRINT, {"publisher": exc}) from exc
            self._reg("set_payload", version, fingerprint=fingerprint, num_bytes=m.bytes, num_tensors=m.num_tensors)
            self._reg("transition", version, S.COMMITTING)
            t = time.perf_counter()
            ok, bad = await self._run(Step.COMMIT, replicas, lambda r: self._commit(r, version, fingerprint, m), m)
            m.commit_seconds += time.perf_counter() - t
            for name in ok:
                self._reg("replica_committed", version, name)
            if bad:
                # Committed peers are ahead of the failed ones, and a non-verify commit failure
                # may be half applied: all of them go back to the last live version.
                restore = ok + [n for n, e in bad.items() if not is_verify_failure(e)]
                raise _StepFailed(Step.COMMIT, bad, retryable=not any(map(is_replica_dead, bad.values())), restore=restore)
            self._reg("go_live", version, [r.name for r in replicas])
            return fingerprint
        except _StepFailed as f:
            if begin_sent:
                await self._run(Step.ABORT, replicas, lambda r: r.abort_update(), m)
            if f.restore:
                f.out_of_service = await self._restore([r for r in replicas if r.name in f.restore], m)
            raise
        finally:
            if pause_sent:
                await self._run(Step.RESUME, replicas, lambda r: r.resume(), m)
                m.paused_seconds += time.perf_counter() - paused

    async def _stream(self, version: int, source: _BucketSource, replicas: list[ReplicaClient], m: PushMetrics) -> None:
        # Pack/put bucket k+1 while bucket k loads; at most one load per replica in flight.
        pending: asyncio.Future | None = None
        try:
            for handle in source:
                if pending is not None:
                    await pending
                payload = self._transport.payload(handle)
                pending = asyncio.ensure_future(self._step(Step.LOAD, replicas, lambda r, p=payload: r.load_bucket(p, version), m))
                await asyncio.sleep(0)  # let the task send its loads before this loop packs the next bucket
            if pending is not None:
                await pending
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    @staticmethod
    async def _commit(r: ReplicaClient, version: int, fingerprint: str, m: PushMetrics) -> None:
        """One replica's commit; records the engine's own reload time when the replica reports it."""
        out = await r.commit_update(version, fingerprint)
        reload_s = out.get("reload_seconds") if isinstance(out, dict) else None
        if isinstance(reload_s, (int, float)):
            m.replica_time(r.name, "reload", float(reload_s))

    async def _run(self, step: Step, replicas: Sequence[ReplicaClient], call: Callable[[ReplicaClient], Awaitable[Any]],
                   m: PushMetrics | None = None) -> tuple[list[str], dict[str, BaseException]]:
        """Call `step` on every replica concurrently, each bounded by timeout_s. Never raises."""
        timeout = self._cfg.timeout_s

        async def one(r: ReplicaClient) -> tuple[str, BaseException | None]:
            t = time.perf_counter()
            try:
                await asyncio.wait_for(call(r), timeout)
                return r.name, None
            except (asyncio.TimeoutError, TimeoutError):
                return r.name, StepTimeout(f"{step.value} on replica {r.name} timed out after {timeout}s")
            except Exception as exc:
                return r.name, exc
            finally:
                if m is not None:
                    m.replica_time(r.name, step.value, time.perf_counter() - t)

        results = await asyncio.gather(*(one(r) for r in replicas))
        return [n for n, e in results if e is None], {n: e for n, e in results if e is not None}

    async def _step(self, step: Step, replicas: Sequence[ReplicaClient], call: Callable[[ReplicaClient], Awaitable[Any]],
                    m: PushMetrics) -> None:
        _, bad = await self._run(step, replicas, call, m)
        if bad:
            raise _StepFailed(step, bad, retryable=not any(map(is_replica_dead, bad.values())))

    # ---- restore / late load ---------------------------------------------------------------
    async def load_live(self, replicas: Sequence[ReplicaClient]) -> list[str]:
        """Push the host copy of the live version to `replicas` (restore or late join).
        Returns the replicas that could not be loaded (left out of service)."""
        m = PushMetrics(self.registry.live_version, self._transport.name, len(replicas))
        await self._settled(m)
        return await self._restore(list(replicas), m)

    async def _restore(self, replicas: list[ReplicaClient], m: PushMetrics) -> list[str]:
        host, failed = self._host, [r.name for r in replicas]
        if host is not None and replicas:
            async def reload(r: ReplicaClient) -> None:
                await r.begin_update(host.version, fingerprint_mode(host.fingerprint))
                for h in host.handles:
                    await r.load_bucket(self._transport.payload(h), host.version)
                await r.commit_update(host.version, host.fingerprint)

            ok, bad = await self._run(Step.RESTORE, replicas, reload, m)
            for name in ok:
                self._reg("replica_loaded", name, host.version)
            failed = list(bad)
            m.rollbacks += len(ok)
            self.totals["rollbacks_total"] += len(ok)
        for name in failed:
            self._reg("replica_removed", name)
            m.out_of_service += 1
            self.totals["out_of_service_total"] += 1
            if self._on_oos is not None:
                with contextlib.suppress(Exception):
                    await _maybe_await(self._on_oos(name, "could not be restored to the last live version"))
        return failed

    # ---- outcome -----------------------------------------------------------------------------
    def _fail(self, version: int, f: _StepFailed, m: PushMetrics) -> WeightsyncError:
        detail = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in f.failures.items())
        message = f"weight push of version {version} failed at step {f.step.value} on replica(s) {sorted(f.failures)} after {m.attempts} attempt(s): {detail}"
        if f.out_of_service:
            message += f"; out of service (need restart): {f.out_of_service}"
        self._reg("transition", version, S.FAILED, error=message)
        m.failed = True
        self.totals["pushes_failed_total"] += 1
        return WeightsyncError(message, version=version, step=f.step, replicas=sorted(f.failures),
                               out_of_service=f.out_of_service, metrics=self._finish(m, version))

    async def _went_live(self, version: int, fingerprint: str, source: "_BucketSource | _StreamedSource", m: PushMetrics) -> list[str]:
        if isinstance(source, _StreamedSource):  # its host copy is still being made: keep it in the background
            self._tail = asyncio.ensure_future(self._keep_live(version, fingerprint, source))
            return []
        report, warnings = await self._keep_live(version, fingerprint, source)
        _report_keep(m, report)
        return warnings

    async def _keep_live(self, version: int, fingerprint: str, source: "_BucketSource | _StreamedSource") -> tuple[dict[str, float], list[str]]:
        """Make `version`'s host copy the one restores use, then run `on_live`. Never raises:
        returns its seconds and its warnings (a live version without a host copy or a store)."""
        t0 = time.perf_counter()
        report: dict[str, float] = {}
        warnings: list[str] = []
        kept = True
        if isinstance(source, _StreamedSource):
            try:
                report.update({f"thread_{k}": v for k, v in (await source.settle(self._cfg.timeout_s)).items()})
            except Exception as exc:  # live everywhere, but nothing to restore from or hand to late joiners
                kept = False
                report["store_failed"] = 1.0
                warnings.append(f"version {version} is live, but the sender's host copies failed ({type(exc).__name__}: {exc}): "
                                "no host copy is kept until the next push (a failed push cannot roll back; late joiners load the last stored version)")
            report["kept"] = time.perf_counter() - t0
        old, self._host = self._host, (_HostCopy(version, fingerprint, source.handles) if kept else None)
        if old is not None:
            for h in old.handles:
                with contextlib.suppress(Exception):
                    self._transport.release(h)
        if kept and self._on_live is not None:
            t = time.perf_counter()
            try:
                buckets = [self._transport.fetch(h) for h in source.handles]
                await asyncio.wait_for(_maybe_await(self._on_live(version, fingerprint, buckets)), self._cfg.timeout_s)
            except Exception as exc:  # the version is live on every replica; only late joiners lag
                report["store_failed"] = 1.0
                warnings.append(f"on_live hook failed for version {version}: {type(exc).__name__}: {exc}")
            report["on_live"] = time.perf_counter() - t
        return report, warnings

    async def _settled(self, m: PushMetrics) -> list[str]:
        """Wait for the last live version's host copy (the tail) before anything reads it; its
        seconds go into `m` (as the previous version's) and its warnings are returned."""
        tail, self._tail = self._tail, None
        if tail is None:
            return []
        t = time.perf_counter()
        report, warnings = await tail
        m.host_copy_wait_seconds = time.perf_counter() - t
        _report_keep(m, report)
        return warnings

    async def drain(self) -> tuple[dict[str, float], list[str]]:
        """Wait for the last live version's host copy; returns its metrics (the keys a next push
        would report for it) and its warnings."""
        m = PushMetrics(self.registry.live_version, self._transport.name, 0)
        warnings = await self._settled(m)
        tail = {"host_copy_seconds", "host_copy_wait_seconds", "on_live_seconds", "store_failed"}
        metrics = {k: v for k, v in m.as_dict().items() if k.removeprefix("weightsync/") in tail or "/host_copy_thread_" in k}
        return metrics, warnings

    def _finish(self, m: PushMetrics, version: int) -> dict[str, float]:
        m.finish()
        out = m.as_dict(self.registry.timeline(version))
        out.update({f"weightsync/{k}": float(v) for k, v in self.totals.items()})
        self.last_metrics = out
        return out


def _report_keep(m: PushMetrics, report: dict[str, float]) -> None:
    """`Publisher._keep_live`'s seconds into `m` (a collective push's go into the next push's)."""
    m.host_copy_seconds = report.get("kept", 0.0)
    m.on_live_seconds, m.store_failed = report.get("on_live", 0.0), bool(report.get("store_failed"))
    m.sender_seconds.update({f"host_copy_{k}": v for k, v in report.items() if k.startswith("thread_")})


def weight_store_hook(store: Any) -> OnLive:
    """`on_live` hook publishing a live version to the generator's `WeightStore` actor.

    The store's copy only serves replicas that start later, so the training loop does not wait
    for it: the call is sent (Ray runs one caller's calls to an actor in order) and its outcome
    is collected at the next push, where a failure surfaces as that push's warning. At most one
    store update is in flight."""
    pending: list[Any] = []

    async def publish(version: int, fingerprint: str, buckets: list[Bucket]) -> None:
        if pending:
            await pending.pop()
        pending.append(store.publish.remote(version, buckets, fingerprint))  # numpy buffers: out of band

    return publish
