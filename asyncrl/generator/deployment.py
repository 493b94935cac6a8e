"""The Ray Serve deployment around `EngineReplica` (transport only; the logic lives in engine.py).

Owns: the replica's Serve surface (generate, generate_stream, check_health, and the control verbs
of `asyncrl.interfaces.EngineAPI`, each forwarded to the replica) and how GeneratorConfig maps onto
Serve deployment options.

Must never: hold logic that `EngineReplica` could hold, or swallow an error without the replica id.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.generator.engine import EngineReplica
from asyncrl.interfaces import ENGINE_CONTROL_VERBS, EngineAPI, verb_name
from asyncrl.types import CompletionDelta, GenerationRequest, GenerationResult, Refusal, failed_applying, refusal_of

ENGINE_DEPLOYMENT = "GeneratorEngine"


def freeze_heap() -> None:
    """Collect, then move every surviving object to the collector's permanent generation."""
    import gc

    gc.collect()
    gc.freeze()


class ReplicaCallError(RuntimeError):
    """A control call failed on one replica; carries the replica id (and the `Refusal`, when the
    replica refused a weight-update step) across the Serve boundary."""

    def __init__(self, replica_id: str, method: str, message: str, refusal: Refusal | None = None,
                 applying: bool = False) -> None:
        super().__init__(f"replica {replica_id}: {method} failed: {message}")
        self.replica_id, self.method, self.message, self.refusal = replica_id, method, message, refusal
        self.applying = applying  # it failed while applying weights: possibly part applied, left paused

    def __reduce__(self):
        return (ReplicaCallError, (self.replica_id, self.method, self.message, self.refusal, self.applying))


def _forward(verb: Callable[..., Any]) -> Callable[..., Any]:
    """The deployment's method for the control verb `verb` of `EngineAPI`: the replica's own, with
    any failure tagged with the replica id (generation errors pass as they are)."""
    name = verb_name(EngineAPI, verb, ENGINE_CONTROL_VERBS)

    @functools.wraps(verb)
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await getattr(self.replica, name)(*args, **kwargs)
        except ReplicaCallError:
            raise
        except Exception as err:
            raise ReplicaCallError(self.replica.replica_id, name, f"{type(err).__name__}: {err}", refusal_of(err),
                                   failed_applying(err)) from None

    return method


class _GeneratorEngine:
    """One vLLM engine per replica. Constructor args are plain dicts so Serve YAML can carry them.
    Its control verbs are `EngineAPI`'s, forwarded to `EngineReplica` (added below, one per verb
    of ENGINE_CONTROL_VERBS): a new verb is written in the interface and in the replica only."""

    async def __init__(
        self,
        model: dict[str, Any],
        generator: dict[str, Any],
        weight_source: str | None = None,
        weight_source_namespace: str | None = None,
    ) -> None:
        from asyncrl.log_setup import asyncrl_logs_at_info

        asyncrl_logs_at_info()  # the replica's own events (a late joiner catching up, its push plan) reach its log
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

    async def check_health(self) -> None:
        await self.replica.check_health()

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()


for _verb in ENGINE_CONTROL_VERBS:
    setattr(_GeneratorEngine, _verb.__name__, _forward(_verb))
GeneratorEngine = serve.deployment(name=ENGINE_DEPLOYMENT)(_GeneratorEngine)


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
        "ray_actor_options": {"num_cpus": gen.num_cpus, "num_gpus": gen.num_gpus, **gen.engine_pool.actor_options(),
                              **_engine_runtime_env(gen)},
        # Engines take ~20 s to boot on CPU; the default 30 s startup budget is too tight under load.
        "health_check_timeout_s": 60,
        # A dead engine fails its replica's health check at once (check_health): found within 2 s, not Serve's 10
        "health_check_period_s": 2,
        "graceful_shutdown_timeout_s": 10,
    }


def _engine_runtime_env(gen: GeneratorConfig) -> dict[str, Any]:
    """`generator.engine_pythonpath` before the replicas' PYTHONPATH (an engine's packages kept apart)."""
    if not gen.engine_pythonpath:
        return {}
    import os

    rest = os.environ.get("PYTHONPATH", "")
    return {"runtime_env": {"env_vars": {"PYTHONPATH": gen.engine_pythonpath + (f":{rest}" if rest else "")}}}
