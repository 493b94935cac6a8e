"""The training loop's weightsync entry point: learner export -> atomic push -> every engine replica.

Owns: wiring one run's pieces together — the learner group's packed export (buckets the ranks
put into the object store themselves), the `Publisher` (order, atomicity, retries, metrics),
the engine deployment as a `ReplicaClient` (Serve's `broadcast` reaches every running replica),
the registry mirror actor (`WeightsyncService`, read by other processes) and the generator's
`WeightStore` (late joiners load the live version from it before they take traffic).

One client for the whole deployment: each step is one broadcast, and it fails if any replica
fails (the error names them), so a version is live only when every running replica committed
it. A replica that starts during a push loads the store's live version in its constructor and
the next push brings it forward; its tokens carry that version, so the buffer's staleness rule
sees it.

Must never: sequence a training step (controller.py), or let a version go live that a running
replica did not commit (push.py enforces it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncrl.config import WeightsyncConfig
from asyncrl.generator.control import EngineControl
from asyncrl.weightsync.push import Publisher, weight_store_hook
from asyncrl.weightsync.registry import VersionRegistry
from asyncrl.weightsync.replicas import ActorReplica
from asyncrl.weightsync.transport import select_transport

log = logging.getLogger(__name__)

REGISTRY_ACTOR = "asyncrl_weightsync"


class DeploymentReplicas(ActorReplica):
    """`ReplicaClient` for every running replica of the engine deployment, one broadcast per step
    (the update steps are ActorReplica's; only how a call reaches the replicas differs)."""

    def __init__(self, control: EngineControl, timeout_s: float, name: str = "engines") -> None:
        super().__init__(control.handle, name)
        self.control, self.timeout_s = control, timeout_s
        self.last_results: dict[str, Any] = {}

    async def _call(self, method: str, *args: Any) -> dict[str, Any]:
        self.last_results = await self.control.call(method, *args, timeout_s=self.timeout_s)
        return self.last_results


class WeightPublisher:
    """`start()` once, then `publish(version)` after each learner update."""

    def __init__(self, cfg: WeightsyncConfig, *, engine: Any, learner: Any, hybrid: bool = False,
                 store_name: str | None = None, namespace: str | None = None) -> None:
        from asyncrl.generator.app import WEIGHT_STORE_NAME, WEIGHT_STORE_NAMESPACE

        self.cfg, self.learner, self.hybrid = cfg, learner, hybrid
        self.replicas = DeploymentReplicas(EngineControl(engine), cfg.timeout_s)
        self.store_name = store_name or WEIGHT_STORE_NAME
        self.namespace = namespace or WEIGHT_STORE_NAMESPACE
        self.publisher: Publisher | None = None
        self.transport: Any = None
        self.store: Any = None
        self.service: Any = None

    async def start(self, initial_version: int = 0) -> None:
        """Create (or attach to) the store and registry actors, and keep a host copy of the
        weights the engines already serve (`initial_version`) so a torn first push can roll back."""
        import ray

        from asyncrl.generator.weights import WeightStore

        await self.replicas.control.wait_ready(timeout_s=max(600.0, self.cfg.timeout_s))
        from asyncrl.weightsync.registry import WeightsyncService

        self.store = ray.remote(WeightStore).options(
            name=self.store_name, namespace=self.namespace, get_if_exists=True, num_cpus=0
        ).remote()
        self.service = ray.remote(WeightsyncService).options(
            name=REGISTRY_ACTOR, namespace=self.namespace, get_if_exists=True, num_cpus=0
        ).remote(initial_version)
        transport = select_transport(self.cfg, on_gpu=torch.cuda.is_available(), hybrid=self.hybrid)
        self.publisher = Publisher(
            self.cfg, transport=transport, registry=VersionRegistry(initial_version),
            mirror=lambda op, *a, **k: self.service.apply.remote(op, *a, **k),
            on_live=weight_store_hook(self.store),
        )
        self.transport = transport
        export = await self.learner.export_hf_tensors_packed(self.cfg.bucket_mb, transport.name)
        from asyncrl.weightsync.bucket import iter_unpacked

        try:
            self.publisher.seed(initial_version, iter_unpacked(transport.fetch(h) for h in export.buckets))
        finally:  # seed re-packs into its own buckets
            for h in export.buckets:
                transport.release(h)

    async def publish(self, version: int) -> dict[str, float]:
        """Push the learner's current weights as `version`; returns the push metrics.
        Raises `WeightsyncError` (nothing published, engines on the previous version) on failure."""
        if self.publisher is None:
            raise RuntimeError("WeightPublisher.start() was not called")
        export = await self.learner.export_hf_tensors_packed(self.cfg.bucket_mb, self.transport.name)
        result = await self.publisher.publish_handles(version, export.buckets, [self.replicas])
        metrics = dict(result.metrics)
        metrics["weightsync/engine_replicas"] = float(len(self.replicas.last_results))
        for warning in result.warnings:
            log.warning("%s", warning)
        return metrics

    def snapshot(self) -> dict[str, Any]:
        return self.publisher.registry.snapshot() if self.publisher else {}
