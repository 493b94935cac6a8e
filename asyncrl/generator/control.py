"""Control operations that must reach every live engine replica (pause, weight updates, sleep, stats).

Owns: fanning one call out to all RUNNING replicas through Ray Serve's `DeploymentHandle.broadcast`, one result per
replica keyed by replica id, and `ReplicaControlError` naming every replica that failed. Weight pushes are
weightsync's (its publisher calls the update steps through `call`). A replica still starting is not reached: it
loads the latest weights from the `WeightStore` in its constructor.
Must never: route a control call through load balancing (it would reach one replica), or report success when any
replica failed.
Details: docs/design/generator.md, "Control operations".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.generator.deployment import ENGINE_DEPLOYMENT, ReplicaCallError
from asyncrl.interfaces import ENGINE_BROADCAST_VERBS, EngineAPI, verb_name
from asyncrl.types import Refusal, ReplicaAnswer, ReplicaControlError  # noqa: F401 - ReplicaControlError: re-exported, what EngineControl raises


def _replica_error(err: BaseException) -> ReplicaCallError | None:
    # Ray wraps remote exceptions in RayTaskError; the original travels as `.cause`.
    seen = 0
    while err is not None and seen < 5:
        if isinstance(err, ReplicaCallError):
            return err
        err = getattr(err, "cause", None) or err.__cause__
        seen += 1
    return None


class EngineControl:
    """Broadcasts calls to the engine deployment's replicas. Use from any async context."""

    def __init__(self, handle: Any = None, *, app_name: str = "default", deployment_name: str = ENGINE_DEPLOYMENT) -> None:
        if handle is None:
            from ray import serve

            handle = serve.get_deployment_handle(deployment_name, app_name=app_name)
        self.handle = handle

    async def call(self, verb: Callable[..., Any], *args: Any, timeout_s: float | None = 120.0,
                   **kwargs: Any) -> dict[str, Any]:
        """Call the control verb `verb` (by reference: `EngineAPI.pause`) on every running replica;
        {replica_id: result}. Raises ReplicaControlError; TypeError for a verb that is not one of
        `EngineAPI`'s ENGINE_BROADCAST_VERBS."""
        method = verb_name(EngineAPI, verb, ENGINE_BROADCAST_VERBS)
        response = self.handle.broadcast(method, *args, **kwargs)
        outcomes = await response.results_async(timeout_s=timeout_s, return_exceptions=True)
        results: dict[str, Any] = {}
        failures: dict[str, str] = {}
        refusals: dict[str, Refusal] = {}
        applying: set[str] = set()
        for i, outcome in enumerate(outcomes):
            if isinstance(outcome, BaseException):
                tagged = _replica_error(outcome)
                rid = tagged.replica_id if tagged else f"unknown-{i}"
                failures[rid] = tagged.message if tagged else f"{type(outcome).__name__}: {outcome}"
                if tagged is not None and tagged.refusal is not None:
                    refusals[rid] = tagged.refusal
                if tagged is not None and tagged.applying:
                    applying.add(rid)
            elif isinstance(outcome, ReplicaAnswer):
                results[outcome.replica_id] = outcome
            elif isinstance(outcome, dict) and "replica_id" in outcome:
                results[outcome["replica_id"]] = outcome
            else:
                results[f"unknown-{i}"] = outcome
        if failures:
            raise ReplicaControlError(method, failures, results, refusals, applying)
        return results

    async def wait_ready(self, timeout_s: float = 600.0, interval_s: float = 1.0) -> dict[str, Any]:
        """Wait until at least one replica is running and answers `stats`; {replica_id: stats}.
        Raises TimeoutError naming the last failure (a deployment that never comes up)."""
        import asyncio
        import time

        deadline, last = time.monotonic() + timeout_s, "no running replica"
        while time.monotonic() < deadline:
            try:
                results = await self.call(EngineAPI.stats, timeout_s=min(60.0, timeout_s))
                if results:
                    return results
            except Exception as err:  # not deployed yet, or replicas still starting
                last = f"{type(err).__name__}: {err}"
            await asyncio.sleep(interval_s)
        raise TimeoutError(f"engine deployment not ready after {timeout_s}s: {last}")

    async def pause(self, mode: str = "keep") -> dict[str, Any]:
        return await self.call(EngineAPI.pause, mode)

    async def resume(self) -> dict[str, Any]:
        return await self.call(EngineAPI.resume)

    async def stats(self) -> dict[str, Any]:
        return await self.call(EngineAPI.stats)

    async def versions(self) -> dict[str, int]:
        return {rid: s["version"] for rid, s in (await self.stats()).items()}
