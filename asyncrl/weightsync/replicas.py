"""The publisher's view of one engine replica: the update steps it calls, nothing else.

Owns: the `ReplicaClient` protocol (the update verbs of `asyncrl.interfaces.EngineAPI`, the
part of the engine's interface a push needs) and `ActorReplica`, the adapter for a Ray actor
handle or a Serve replica handle that implements `EngineAPI`.

The contract weightsync relies on (generator side):
  pause(mode)                     stop scheduling; "keep" keeps in-flight requests' KV
  begin_update(version, verify, staging, layout, plan_id)
                                  drop any staged copy; start staging `version`, hashing each
                                  bucket as it arrives in `verify` mode (full | sampled | checksum | off);
                                  layout "engine" (buckets of push plan `plan_id`, copied into the
                                  parameters; a replica without that plan refuses: Refusal.PLAN_MISSING) or
                                  "hf" (reloaded); staging "full" or "bucketed" (apply each bucket
                                  once it matches the sender's digests that come with it)
  load_bucket(bucket, version)    stage one `Bucket` (the transport payload: for the object store
                                  an ObjectRef that Ray resolves to the bucket; a `Bucket`
                                  iterates as (name, tensor) views, so it is a NamedTensors);
                                  never touches live weights
  commit_update(version, fp)      verify the staged tensors hash to `fp` ("<mode>:<hex>") FIRST, then apply them
                                  in place and relabel the version; a fingerprint mismatch must
                                  raise before anything is applied (an error whose `.refusal`,
                                  or its cause's, is Refusal.VERIFY_FAILED), any later error may leave the
                                  weights partially applied. A replica not paused by the caller
                                  pauses for the apply itself and resumes after it (a failed
                                  apply leaves it paused until `resume`)
  abort_update()                  drop staged tensors; idempotent; the live version is untouched
  resume()                        resume scheduling
Restoring a replica whose commit failed part-way (or that committed while a peer failed) from
the publisher's host copy: `begin_update` accepts the last live version again (a version <=
the replica's current one is a restore; the replica's label goes back with its weights). A
replica that still cannot be restored is reported out of service (push.py), to be restarted;
on start it loads the generator's WeightStore.

Must never: retry, time out or order calls (push.py does all three).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from asyncrl.interfaces import EngineAPI, verb_name
from asyncrl.types import Refusal, error_chain, failed_applying, refusal_of


@runtime_checkable
class ReplicaClient(Protocol):
    name: str

    async def pause(self, mode: str) -> Any: ...

    async def begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf",
                           plan_id: str | None = None) -> Any: ...

    async def load_bucket(self, payload: Any, version: int) -> Any: ...

    async def commit_update(self, version: int, fingerprint: str) -> Any: ...

    async def abort_update(self) -> Any: ...

    async def resume(self) -> Any: ...


class ActorReplica:
    """Adapter for a handle whose `handle.<method>.remote(...)` returns something awaitable
    (a Ray ObjectRef for an actor, a DeploymentResponse for a Serve replica handle)."""

    fanout = 1  # engine replicas one call reaches

    def __init__(self, handle: Any, name: str) -> None:
        self.handle = handle
        self.name = name

    async def _call(self, verb: Callable[..., Any], *args: Any) -> Any:
        return await getattr(self.handle, verb_name(EngineAPI, verb)).remote(*args)

    async def pause(self, mode: str) -> Any:
        return await self._call(EngineAPI.pause, mode)

    async def begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf",
                           plan_id: str | None = None) -> Any:
        return await self._call(EngineAPI.begin_update, version, verify, staging, layout, plan_id)

    async def load_bucket(self, payload: Any, version: int) -> Any:
        # The payload goes as a top-level argument so Ray resolves an ObjectRef before the call.
        return await self._call(EngineAPI.load_bucket, payload, version)

    async def commit_update(self, version: int, fingerprint: str) -> Any:
        return await self._call(EngineAPI.commit_update, version, fingerprint)

    async def abort_update(self) -> Any:
        return await self._call(EngineAPI.abort_update)

    async def resume(self) -> Any:
        return await self._call(EngineAPI.resume)

    def __repr__(self) -> str:
        return f"ActorReplica({self.name!r})"


def is_verify_failure(exc: BaseException) -> bool:
    """A commit that failed its fingerprint check applied nothing (generator contract above): the
    replica refused it with `Refusal.VERIFY_FAILED`."""
    return refusal_of(exc) is Refusal.VERIFY_FAILED


def is_apply_failure(exc: BaseException) -> bool:
    """A replica failed while applying (its error, or one it was raised from, says `applying`): it
    may be part applied and stays paused until it is restored."""
    return failed_applying(exc)


def partly_done(exc: BaseException) -> bool:
    """A call that fanned out failed on some replicas but returned on others (the error, or one it
    was raised from, carries their non-empty `results`, as the generator's EngineControl does)."""
    return any(isinstance(getattr(e, "results", None), dict) and bool(e.results) for e in error_chain(exc))


def is_replica_dead(exc: BaseException) -> bool:
    """The replica process is gone: retrying the same replica cannot help."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, RayActorError) and type(exc).__name__ != "ActorUnavailableError"
