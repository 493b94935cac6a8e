"""The Ray Serve deployment around `EngineReplica` (transport only; the logic lives in engine.py).

Owns: the replica's Serve surface (generate, generate_stream, control methods, check_health)
and how GeneratorConfig maps onto Serve deployment options.

Must never: hold logic that `EngineReplica` could hold, or swallow an error without the replica id.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.generator.engine import EngineReplica, PauseMode
from asyncrl.types import CompletionDelta, GenerationRequest, GenerationResult

ENGINE_DEPLOYMENT = "GeneratorEngine"


def freeze_heap() -> None:
    """Collect, then move every surviving object to the collector's permanent generation."""
    import gc

    gc.collect()
    gc.freeze()


class ReplicaCallError(RuntimeError):
    """A control call failed on one replica; carries the replica id across the Serve boundary."""

    def __init__(self, replica_id: str, method: str, message: str) -> None:
        super().__init__(f"replica {replica_id}: {method} failed: {message}")
        self.replica_id, self.method, self.message = replica_id, method, message

    def __reduce__(self):
        return (ReplicaCallError, (self.replica_id, self.method, self.message))


def _control(fn):
    """Tag any failure of a control method with the replica id (generation errors pass as they are)."""

    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        try:
            return await fn(self, *args, **kwargs)
        except ReplicaCallError:
            raise
        except Exception as err:
            raise ReplicaCallError(self.replica.replica_id, fn.__name__, f"{type(err).__name__}: {err}") from None

    return wrapper


@serve.deployment(name=ENGINE_DEPLOYMENT)
class GeneratorEngine:
    """One vLLM engine per replica. Constructor args are plain dicts so Serve YAML can carry them."""

    async def __init__(
        self,
        model: dict[str, Any],
        generator: dict[str, Any],
        weight_source: str | None = None,
        weight_source_namespace: str | None = None,
    ) -> None:
        try:
            replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (local testing mode)
            replica_id = "local"
        self.replica = EngineReplica(
            ModelConfig.model_validate(model),
            GeneratorConfig.model_validate(generator),
            replica_id=replica_id,
            weight_source=weight_source,
            weight_source_namespace=weight_source_namespace,
        )
        # Async init: Serve marks the replica running (and routes to it) only after this returns,
        # so a late joiner has loaded the current weights before its first request.
        await self.replica.start()
        # As `vllm serve` does once started: the start-up heap (torch, vLLM, Ray) leaves the
        # collector's view, so the collections the serving loop triggers walk only live objects.
        freeze_heap()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        return await self.replica.generate(request)

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[list[CompletionDelta]]:
        async for deltas in self.replica.generate_stream(request):
            yield deltas

    @_control
    async def pause(self, mode: PauseMode = "keep") -> dict[str, Any]:
        return await self.replica.pause(mode)

    @_control
    async def resume(self) -> dict[str, Any]:
        return await self.replica.resume()

    @_control
    async def begin_update(self, version: int, verify: str = "full", staging: str = "full", layout: str = "hf",
                           plan_id: str | None = None) -> dict[str, Any]:
        return await self.replica.begin_update(version, verify, staging, layout, plan_id)

    @_control
    async def load_bucket(self, named_tensors: Any, version: int | None = None) -> dict[str, Any]:
        return await self.replica.load_bucket(named_tensors, version)

    @_control
    async def commit_update(self, version: int, fingerprint: str) -> dict[str, Any]:
        return await self.replica.commit_update(version, fingerprint)

    @_control
    async def abort_update(self) -> dict[str, Any]:
        return await self.replica.abort_update()

    @_control
    async def engine_layout(self, manifest: bytes) -> dict[str, Any]:
        return await self.replica.engine_layout(manifest)

    @_control
    async def set_push_plan(self, plan: bytes | None) -> dict[str, Any]:
        return await self.replica.set_push_plan(plan)

    @_control
    async def collective_info(self) -> dict[str, Any]:
        return await self.replica.collective_info()

    @_control
    async def join_collective(self, specs: list[dict[str, Any]], timeout_s: float = 120.0) -> dict[str, Any]:
        return await self.replica.join_collective(specs, timeout_s)

    @_control
    async def leave_collective(self) -> dict[str, Any]:
        return await self.replica.leave_collective()

    @_control
    async def sync_from_source(self) -> dict[str, Any]:
        return await self.replica.sync_from_source()

    @_control
    async def sleep(self, level: int = 1) -> dict[str, Any]:
        return await self.replica.sleep(level)

    @_control
    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return await self.replica.wake_up(tags)

    @_control
    async def stats(self) -> dict[str, Any]:
        return await self.replica.stats()

    @_control
    async def live_fingerprint(self) -> dict[str, Any]:
        return {"replica_id": self.replica.replica_id, "fingerprint": await self.replica.live_fingerprint()}

    async def check_health(self) -> None:
        await self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()


def engine_deployment_options(gen: GeneratorConfig) -> dict[str, Any]:
    """Serve options of the engine deployment, from GeneratorConfig."""
    a = gen.autoscaling
    autoscaling: dict[str, Any] = {
        "min_replicas": a.min_replicas,
        "max_replicas": a.max_replicas,
        "target_ongoing_requests": a.target_ongoing_requests,
        "upscale_delay_s": a.upscale_delay_s,
        "downscale_delay_s": a.downscale_delay_s,
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": a.look_back_period_s,
    }
    if a.initial_replicas is not None:
        autoscaling["initial_replicas"] = a.initial_replicas
    extra: dict[str, Any] = {}
    if gen.routing == "prefix_affinity":
        from ray.serve.config import RequestRouterConfig

        from asyncrl.generator.routing import PrefixAffinityRouter

        extra["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter)
    return {
        **extra,
        "autoscaling_config": autoscaling,
        "max_ongoing_requests": gen.max_ongoing_requests,
        "max_queued_requests": gen.max_queued_requests,
        "ray_actor_options": {"num_cpus": gen.num_cpus, "num_gpus": gen.num_gpus, **gen.engine_pool.actor_options()},
        # Engines take ~20 s to boot on CPU; the default 30 s startup budget is too tight under load.
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": 10,
    }
