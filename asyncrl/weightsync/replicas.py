"""The publisher's view of one engine replica: the update steps it calls, nothing else.

Owns: the `ReplicaClient` protocol (the update verbs of `asyncrl.interfaces.EngineAPI`), `ActorReplica` (for a Ray
actor or Serve replica handle) and `DeploymentReplicas` (every running replica of the engine deployment as one
client).
The contract weightsync relies on: pause(mode); begin_update(version, verify, staging, layout, plan_id) drops any
staged copy and starts staging (a replica without the plan refuses: Refusal.PLAN_MISSING); load_bucket stages one
bucket and never touches live weights; commit_update(version, fp) raises before applying anything when the
fingerprint differs (Refusal.VERIFY_FAILED) and may leave the weights part-applied on any later error; abort_update is
idempotent and leaves the live version untouched; resume. A version <= the replica's current one is a restore.
Must never: retry, time out or order calls (push.py does all three).
Details (every verb in full): docs/design/weightsync.md, "Replica clients".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from asyncrl.interfaces import EngineAPI, verb_name
from asyncrl.types import CommitReport, LoadReport, Refusal, UpdateAck, refusal_of

Loaded = LoadReport | CommitReport  # a load that only staged, or one that also committed


@runtime_checkable
class ReplicaClient(Protocol):
    """Each update verb answers one replica's typed answer (asyncrl.types), or {replica id: answer} from a
    client that fans out."""

    name: str
    fanout: int  # engine replicas one call reaches

    async def pause(self, mode: str) -> Any: ...

    async def begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf",
                           plan_id: str | None = None) -> UpdateAck | dict[str, UpdateAck]: ...

    async def load_bucket(self, payload: Any, version: int) -> Loaded | dict[str, Loaded]: ...

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport | dict[str, CommitReport]: ...

    async def abort_update(self) -> UpdateAck | dict[str, UpdateAck]: ...

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
                           plan_id: str | None = None) -> UpdateAck | dict[str, UpdateAck]:
        return await self._call(EngineAPI.begin_update, version, verify, staging, layout, plan_id)

    async def load_bucket(self, payload: Any, version: int) -> Loaded | dict[str, Loaded]:
        # The payload goes as a top-level argument so Ray resolves an ObjectRef before the call.
        return await self._call(EngineAPI.load_bucket, payload, version)

    async def commit_update(self, version: int, fingerprint: str) -> CommitReport | dict[str, CommitReport]:
        return await self._call(EngineAPI.commit_update, version, fingerprint)

    async def abort_update(self) -> UpdateAck | dict[str, UpdateAck]:
        return await self._call(EngineAPI.abort_update)

    async def resume(self) -> Any:
        return await self._call(EngineAPI.resume)

    def __repr__(self) -> str:
        return f"ActorReplica({self.name!r})"


class DeploymentReplicas(ActorReplica):
    """`ReplicaClient` for every running replica of the engine deployment, one broadcast per step
    (the update steps are ActorReplica's; only how a call reaches the replicas differs).
    `control` fans a verb out (`await control.call(EngineAPI.pause, *args, timeout_s=...)` ->
    {replica id: result}: the generator's EngineControl)."""

    def __init__(self, control: Any, timeout_s: float, name: str = "engines") -> None:
        super().__init__(getattr(control, "handle", None), name)
        self.control, self.timeout_s = control, timeout_s
        self.last_results: dict[str, Any] = {}

    @property
    def fanout(self) -> int:  # type: ignore[override]
        """Engine replicas the last call reached (2 before any: not known to be one)."""
        return len(self.last_results) if self.last_results else 2

    async def _call(self, verb: Callable[..., Any], *args: Any) -> dict[str, Any]:
        self.last_results = await self.control.call(verb, *args, timeout_s=self.timeout_s)
        return self.last_results

    async def call_all(self, verb: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """`verb` on every running replica, {replica id: result}; `fanout` counts them from now on."""
        return await self._call(verb, *args)


def is_verify_failure(exc: BaseException) -> bool:
    """A commit that failed its fingerprint check applied nothing (generator contract above): the
    replica refused it with `Refusal.VERIFY_FAILED`."""
    return refusal_of(exc) is Refusal.VERIFY_FAILED


def is_replica_dead(exc: BaseException) -> bool:
    """The replica process is gone: retrying the same replica cannot help."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return isinstance(exc, RayActorError) and type(exc).__name__ != "ActorUnavailableError"
