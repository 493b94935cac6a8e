"""Where a push's buckets come from, as the publisher sees them (push.py drives them), and what a replica is to it.

Owns: `Step` / `StepFailed`, a push's metrics (`PushMetrics`), `ReplicaClient` (`ActorReplica`: one Ray actor or Serve
replica; `DeploymentReplicas`: every running replica) and the replicas' contract: pause(mode); load_bucket(payload,
version, begin) stages the whole version and never touches live weights, its `begin` first drops any staged copy (an
engine layout without the plan: Refusal.PLAN_MISSING); commit_update(version, fp) applies nothing on a fingerprint
mismatch (Refusal.VERIFY_FAILED), may leave the weights part-applied on a later error; abort_update is idempotent; a
version <= the live one restores. The sources: `BucketSource`, the buckets the learner ranks put; `StreamedSource`, a
collective push over a `Link` (link.py). Must never: order replica calls or decide what is live (push.py)."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from asyncrl.interfaces import EngineAPI, verb_name
from asyncrl.types import CommitReport, HostCopies, LoadReport, Refusal, ReplicaControlError, UpdateAck, UpdateBegin, WeightExport, refusal_of
from asyncrl.weightsync.bucket import digest_key_prefix
from asyncrl.weightsync.fingerprint import VerifyMode, bucket_digests, check_verify_mode, combine_digests
from asyncrl.weightsync.transport import Channel


class ReplicaClient(Protocol):
    """Each update verb answers one replica's typed answer (asyncrl.types), or {replica id: answer} from a
    client that fans out."""

    name: str
    fanout: int  # engine replicas one call reaches

    async def pause(self, mode: str) -> Any: ...
    async def load_bucket(self, payload: Any, version: int, begin: UpdateBegin) -> LoadReport | dict[str, LoadReport]: ...
    async def commit_update(self, version: int, fingerprint: str) -> CommitReport | dict[str, CommitReport]: ...
    async def abort_update(self) -> UpdateAck | dict[str, UpdateAck]: ...
    async def resume(self) -> Any: ...


class ActorReplica:
    """Adapter for a handle whose `handle.<method>.remote(...)` returns something awaitable
    (a Ray ObjectRef for an actor, a DeploymentResponse for a Serve replica handle)."""

    fanout = 1

    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name

    async def call(self, verb: Callable[..., Any], *args: Any) -> Any:
        """`verb` (an `EngineAPI` method) on the replica(s) this client reaches."""
        return await getattr(self.handle, verb_name(EngineAPI, verb)).remote(*args)

    async def pause(self, mode: str) -> Any:
        return await self.call(EngineAPI.pause, mode)

    async def load_bucket(self, payload: Any, version: int, begin: UpdateBegin) -> LoadReport | dict[str, LoadReport]:
        return await self.call(EngineAPI.load_bucket, payload, version, begin)

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport | dict[str, CommitReport]:
        return await self.call(EngineAPI.commit_update, version, fingerprint)

    async def abort_update(self) -> UpdateAck | dict[str, UpdateAck]:
        return await self.call(EngineAPI.abort_update)

    async def resume(self) -> Any:
        return await self.call(EngineAPI.resume)


class DeploymentReplicas(ActorReplica):
    """Every running replica of the engine deployment, one broadcast a step through `control` (the generator's
    EngineControl: `await control.call(EngineAPI.pause, *args, timeout_s=...)` -> {replica id: result})."""

    def __init__(self, control: Any, timeout_s: float, name: str = "engines") -> None:
        super().__init__(None, name)
        self.control, self.timeout_s = control, timeout_s
        self.last_results: dict[str, Any] = {}

    @property
    def fanout(self) -> int:  # type: ignore[override]
        """Engine replicas the last call reached (2 before any: not known to be one)."""
        return len(self.last_results) if self.last_results else 2

    async def call(self, verb: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """`verb` on every running replica, {replica id: result}; `fanout` counts them from now on."""
        self.last_results = await self.control.call(verb, *args, timeout_s=self.timeout_s)
        return self.last_results


def refusals_of(failures: dict[str, BaseException]) -> dict[str, Refusal]:
    """{replica: why it refused} of a step's failures: a fanned-out call's per replica (one replica's refusal
    closes a broadcast push's gate, and the others then fail without one), else each client's own."""
    return {k: r for name, e in failures.items()
            for k, r in (e.refusals if isinstance(e, ReplicaControlError) else {name: refusal_of(e)}).items() if r}


# ---- a push's metrics ------------------------------------------------------------------------------------

@dataclass
class PushMetrics:
    version: int
    transport: str
    num_replicas: int
    started: float = field(default_factory=time.perf_counter)
    bytes: int = 0
    num_tensors: int = 0
    num_buckets: int = 0
    failed: bool = False
    push_seconds: float = 0.0
    stage_seconds: float = 0.0
    commit_seconds: float = 0.0
    fingerprint_seconds: float = 0.0
    put_seconds: float = 0.0
    rollbacks: int = 0
    out_of_service: int = 0
    store_failed: bool = False
    on_live_seconds: float = 0.0
    paused_seconds: float = 0.0
    layout: str = "hf"
    paths: set[str] = field(default_factory=set)  # apply paths the replicas reported ("direct", "reload")
    own_paused: float = 0.0  # the longest pause a replica's commit took itself
    failed_commit: bool = False
    host_copy_wait_seconds: float = 0.0
    host_copy_seconds: float = 0.0
    sender_seconds: dict[str, float] = field(default_factory=dict)  # collective transports: the sender's phases
    replica_seconds: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))

    def replica_time(self, replica: str, step: str, seconds: float) -> None:
        self.replica_seconds[replica][step] += seconds

    def finish(self) -> None:
        self.push_seconds = time.perf_counter() - self.started
        self.paused_seconds = max(self.paused_seconds, self.own_paused)

    def as_dict(self, timeline: list[tuple[str, float]] | None = None) -> dict[str, float]:
        p = "weightsync/"
        plain = ("version", "bytes", "num_tensors", "num_buckets", "num_replicas", "failed",
                 "rollbacks", "out_of_service", "store_failed", "push_seconds", "on_live_seconds", "paused_seconds",
                 "host_copy_wait_seconds", "host_copy_seconds", "stage_seconds", "commit_seconds", "fingerprint_seconds")
        out: dict[str, float] = {p + k: float(v) if isinstance(v := getattr(self, k), bool) else v for k in plain}
        out.update({p + "gbps": self.bytes / self.push_seconds / 1e9 if self.push_seconds > 0 else 0.0,
                    p + "layout_engine": float(self.layout == "engine")})
        t = f"{p}transport/{self.transport}/"
        out[t + "bytes"] = self.bytes
        out[t + "put_seconds"] = self.put_seconds
        for phase, seconds in sorted(self.sender_seconds.items()):
            out[f"{p}sender/{phase}_seconds"] = seconds
        apply_s = max((steps.get("apply", 0.0) for steps in self.replica_seconds.values()), default=0.0)
        out[p + "apply_seconds"] = apply_s
        if self.paths:
            out[p + "apply_direct"] = float(self.paths == {"direct"})
        for name, steps in sorted(self.replica_seconds.items()):
            r = f"{p}replica/{name}/"
            out[r + "load_seconds"] = steps.get("load_bucket", 0.0)
            out[r + "commit_seconds"] = steps.get("commit_update", 0.0)
            for step, seconds in steps.items():
                if step not in ("load_bucket", "commit_update"):
                    out[f"{r}{step}_seconds"] = seconds
        if timeline:
            t0 = timeline[0][1]
            for state, ts in timeline:
                out[f"{p}timeline/{state}_s"] = ts - t0
        return out


class Step(str, enum.Enum):
    EXPORT = "export"  # reading the tensor stream / packing
    PAUSE = "pause"
    LOAD = "load_bucket"
    COMMIT = "commit_update"
    ABORT = "abort_update"
    RESUME = "resume"
    RESTORE = "restore"


@dataclass
class StepFailed(Exception):
    step: Step
    failures: dict[str, BaseException]
    restore: list[str] = field(default_factory=list)  # replicas to put back on the last live version
    out_of_service: list[str] = field(default_factory=list)


class _Source:
    """What the publisher reads of a source: its verify mode and layout, the handles of its buckets once they are there
    (what a restore pushes again, what late joiners load), their fingerprint, and what becomes of them after the push."""

    layout: str = "hf"  # "engine": packed for `plan_id`
    plan_id: str | None = None
    version: int | None = None  # the version it went live as, once it is the host copy a restore pushes again

    def __init__(self, transport: Channel, verify: VerifyMode) -> None:
        self._transport, self.verify = transport, check_verify_mode(verify)
        self.handles: list[Any] = []
        self._digests: dict[str, bytes] | None = None

    def fingerprint(self) -> str:  # (once `stream` returned: a streamed source's digests are the senders')
        return combine_digests(self._digests, self.verify)

    async def settle(self, timeout_s: float) -> dict[str, float]:
        """Collect the host copies, made once the push went live (they become `handles`); returns the seconds of the
        thread that made them."""
        return {}

    def discard(self) -> None:
        """Release a failed push's buckets: nobody will read them again."""
        for h in self.handles:
            with contextlib.suppress(Exception):
                self._transport.release(h)


class BucketSource(_Source):
    """Buckets the learner ranks already put into the transport, with the digests they computed as they packed (else
    hashed here). Read once, when made: a bad handle, or a tensor in two buckets, fails before the push registers."""

    def __init__(self, handles: Sequence[Any], transport: Channel, verify: VerifyMode = "full",
                 digests: Sequence[dict[str, bytes]] | None = None, plan_id: str | None = None) -> None:
        super().__init__(transport, verify)
        self.handles, self._digests = list(handles), {}
        self.bytes = self.num_tensors = 0
        self.hash_seconds = 0.0
        if digests is None or len(digests) != len(self.handles):
            digests = [{}] * len(self.handles)
        ranks = set()
        for h, given in zip(self.handles, digests):
            bucket = transport.fetch(h)
            ranks.add(bucket.rank)
            names = {digest_key_prefix(bucket) + n for n in bucket.names}
            if len(names) != len(bucket.names) or not names.isdisjoint(self._digests):
                raise ValueError(f"a tensor name appears twice across the {len(self.handles)} bucket handles")
            self.bytes += bucket.payload_bytes
            self.num_tensors += len(bucket)
            if set(given) != names:
                t = time.perf_counter()
                given = bucket_digests(bucket, self.verify, digest_key_prefix(bucket))
                self.hash_seconds += time.perf_counter() - t
            self._digests.update(given)
        if ranks - {None}:  # (one export: every sender packs for the plan set on all of them, or none)
            if plan_id is None:
                raise ValueError("engine-layout buckets without the push plan they were packed for")
            self.layout, self.plan_id = "engine", plan_id

    async def stream(self, step: Callable[..., Awaitable[None]], version: int, replicas: list[ReplicaClient],
                     m: PushMetrics, begin: UpdateBegin) -> None:
        """Every replica's one load (beginning the update) takes every bucket, in order."""
        m.bytes, m.num_tensors, m.num_buckets = self.bytes, self.num_tensors, len(self.handles)
        m.fingerprint_seconds = self.hash_seconds
        payload = [self._transport.payload(h) for h in self.handles]
        await step(Step.LOAD, replicas, lambda r: r.load_bucket(payload, version, begin), m)


class Link(Protocol):
    """A collective push's broadcast groups (link.py's `CollectiveLink`): `ensure` them before each attempt, the
    replicas' `payload`, the senders' `send` (a `WeightExport`), `stop` a sender waiting for a member that will not
    answer, `collect` the last send's host copies once live. `sequential` (ipc): loads open what `send` answered."""

    sequential: bool

    async def ensure(self) -> Any: ...
    def payload(self, version: int) -> Any: ...
    async def send(self, version: int, verify: str) -> WeightExport: ...
    async def stop(self, why: str) -> Any: ...
    async def collect(self) -> HostCopies: ...


# How long a sender may still run once every receiver's load returned before it is stopped: a receiver
# acknowledges before its load returns, and a sender polls acknowledgements every fraction of a millisecond.
CANCEL_GRACE_S = 1.0


class StreamedSource(_Source):
    """A collective push: the senders broadcast every bucket (`link.send`) while each replica's single
    `load_bucket(link.payload(version))` receives them; no bucket passes through the publisher. The senders' host
    copies become the handles, their digests the fingerprint."""

    def __init__(self, link: Link, transport: Channel, timeout_s: float, verify: VerifyMode = "full",
                 plan_id: str | None = None) -> None:
        super().__init__(transport, verify)
        self._link, self._timeout_s = link, timeout_s
        if plan_id is not None:
            self.layout, self.plan_id = "engine", plan_id
        self._sent = False  # the senders sent: their host copies are there to collect

    async def stream(self, step: Callable[..., Awaitable[None]], version: int, replicas: list[ReplicaClient],
                     m: PushMetrics, begin: UpdateBegin) -> None:
        """Every replica's load (beginning the update) receives what the senders broadcast."""
        t = time.perf_counter()
        try:
            await asyncio.wait_for(self._link.ensure(), self._timeout_s)
        except Exception as exc:
            raise StepFailed(Step.LOAD, {"broadcast group": exc}) from exc
        prepared = time.perf_counter()

        def loads(payload: Any) -> asyncio.Future:
            return asyncio.ensure_future(step(Step.LOAD, replicas, lambda r: r.load_bucket(payload, version, begin), m))

        # ipc (`sequential`): the loads open the handles the senders' export answered, so they start after it
        receiving = None if self._link.sequential else loads(self._link.payload(version))
        try:
            sent = await self._send(version, receiving)
        except Exception as exc:
            # The receivers' failures follow from the sender's (its abort header, or their deadline), unless
            # one refused the push (e.g. PLAN_MISSING): then the sender's follows from it, and the push reports it.
            if receiving is not None:
                with contextlib.suppress(BaseException):
                    await receiving
                refused = receiving.exception() if receiving.done() and not receiving.cancelled() else None
                if isinstance(refused, StepFailed) and refusals_of(refused.failures):
                    raise refused from exc
            raise StepFailed(Step.EXPORT, {"publisher": exc}) from exc
        except BaseException:
            if receiving is not None:
                receiving.cancel()
            raise
        sent_at = time.perf_counter()
        self._sent = True  # collected once live: on a shared GPU the copies would take turns with the engines' apply
        await (receiving or loads(self._link.payload(version)))
        self._digests = sent.tensor_digests()
        m.bytes, m.num_tensors, m.num_buckets = sent.bytes, sent.num_tensors, sent.num_buckets
        m.put_seconds = sent.seconds.get("broadcast", 0.0)
        m.fingerprint_seconds = sent.seconds.get("hash", 0.0)
        m.sender_seconds.update(sent.seconds)
        # where the stage's time goes, as the publisher sees it: forming / checking the groups,
        # the sender's call (its own seconds are in sent.seconds), the receivers after it returned
        m.sender_seconds.update({"prepare": prepared - t, "call": sent_at - prepared,
                                 "receivers_after": time.perf_counter() - sent_at})

    async def _send(self, version: int, receiving: asyncio.Future | None) -> WeightExport:
        """The senders' call, bounded by the timeout. A sender still running `CANCEL_GRACE_S` after every replica's
        load returned waits for a member that will not answer (one no load reached, or whose load failed before it
        could tell the sender): it is stopped (`link.stop`) instead of at its deadline."""
        sending = asyncio.ensure_future(asyncio.wait_for(self._link.send(version, self.verify), self._timeout_s))
        try:
            if receiving is not None:
                await asyncio.wait({sending, receiving}, return_when=asyncio.FIRST_COMPLETED)
                done, _ = await asyncio.wait({sending}, timeout=CANCEL_GRACE_S)
                if not done:
                    failed = receiving.exception() if not receiving.cancelled() else None
                    await self._link.stop(f"every replica's load of version {version} returned "
                                          f"({'failed: ' + str(failed)[:500] if failed else 'ok'}) "
                                          f"and the sender still waited {CANCEL_GRACE_S:.0f} s later")
            return await sending
        except BaseException:
            sending.cancel()
            raise

    async def settle(self, timeout_s: float) -> dict[str, float]:
        sent, self._sent = self._sent, False
        if not sent:
            return {}
        kept = await asyncio.wait_for(self._link.collect(), timeout_s)
        self.handles = list(kept.buckets)
        return dict(kept.seconds)

    def discard(self) -> None:  # (the host copies of a failed push, once they arrive: none may linger)
        sent, self._sent = self._sent, False

        def release(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is None:
                for h in done.result().buckets:
                    with contextlib.suppress(Exception):
                        self._transport.release(h)

        if sent:
            asyncio.ensure_future(self._link.collect()).add_done_callback(release)
