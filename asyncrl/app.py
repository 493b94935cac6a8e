"""`serve run deploy/rlhf.yaml`: the whole system as one Ray Serve application.

Owns: the application graph, built in one place (`build_app`) for the full app and for the
generator alone (`deploy/generator.yaml`, `run_generator`): engine deployment (autoscaled vLLM
replicas), the trainer deployment (the training loop, one replica; full app only), and the HTTP
gateway in front of both; and the trainer deployment's thin Serve surface (status, health).
Must never: contain training logic (trainer/loop.py) or engine logic (asyncrl/generator).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from ray import serve

from asyncrl.cluster import GATEWAY_NUM_CPUS, TRAINER_NUM_CPUS, check_live_cluster
from asyncrl.config import RootConfig, load_config
from asyncrl.generator.deployment import GeneratorEngine, engine_deployment_options
from asyncrl.generator.gateway import GeneratorGateway
from asyncrl.weightsync.service import STORE_NAME as WEIGHT_STORE_NAME
from asyncrl.weightsync.service import STORE_NAMESPACE as WEIGHT_STORE_NAMESPACE

log = logging.getLogger(__name__)

TRAINER_DEPLOYMENT = "Trainer"
# Top-level keys the generator-only app takes beside the config sections: the WeightStore actor late
# replicas load from (default `asyncrl_weight_store` in namespace `asyncrl`) and the training
# loop's status actor behind `GET /train/status`.
GENERATOR_EXTRA_KEYS = ("weight_source", "weight_source_namespace", "status_actor", "status_namespace")


# How long a stopping trainer may take: the step in progress finishes (its push too) within
# DRAIN_S or is cancelled, then the learner ranks, reward workers and buffer are closed. Serve
# waits for it up to its graceful-shutdown timeout (SIGINT / SIGTERM of `serve run`, a redeploy).
DRAIN_S = 30.0
CLOSE_S = 15.0


@serve.deployment(name=TRAINER_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": TRAINER_NUM_CPUS}, max_ongoing_requests=64,
                  graceful_shutdown_timeout_s=DRAIN_S + CLOSE_S + 5)
class TrainerDeployment:
    """Runs the training loop as a background task; answers status while it runs; drains when
    Serve stops it."""

    def __init__(self, cfg: dict[str, Any], engine: Any) -> None:
        from asyncrl.trainer.logging_setup import configure_logging

        self.cfg = load_config(cfg, source="trainer deployment")
        configure_logging(self.cfg.logging)
        self._engine = engine
        self._trainer: Any = None
        self._parts: Any = None
        self._phase = "starting"
        self._error: str | None = None
        self._task = asyncio.get_running_loop().create_task(self._main(), name="training-loop")

    async def _main(self) -> None:
        from asyncrl.trainer.loop import Trainer
        from asyncrl.trainer.parts import TrainerParts

        parts = None
        try:
            parts = self._parts = await TrainerParts.create(self.cfg, self._engine)
            self._trainer = Trainer(self.cfg, parts)
            self._phase = "training"
            await self._trainer.run()
            self._phase = self._trainer.state.value
        except Exception as err:  # the loop's failure is reported by status(), never lost
            self._phase, self._error = "failed", f"{type(err).__name__}: {err}"
            log.exception("training loop failed")
        finally:
            if parts is not None:
                parts.tracker.plot()

    async def status(self) -> dict[str, Any]:
        from asyncrl.cluster import waits_now

        if self._trainer is not None:
            snapshot = self._trainer.status()
            if self._phase == "failed":
                snapshot.update(state="failed", error=self._error)
        else:
            snapshot = {"state": self._phase, "error": self._error, "step": 0, "policy_version": 0}
        # What the start or a learner restart waits for Ray to place, and why (a pool no live node offers)
        return snapshot | {"waiting_for": waits_now()}

    async def __del__(self) -> None:
        """Serve is stopping this replica: end the loop at a step boundary, log the accounting,
        close the parts (learner ranks, reward workers, buffer)."""
        if self._trainer is not None and not self._task.done():
            self._trainer.request_stop()
            log.info("stopping: the step in progress finishes (at most %.0f s), rollouts stop", DRAIN_S)
        try:
            await asyncio.wait_for(asyncio.shield(self._task), DRAIN_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            log.warning("the training loop did not stop within %.0f s; cancelled (a push in progress is abandoned: "
                        "engines keep the last live version)", DRAIN_S)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        parts = self._parts
        if parts is None:
            return
        from asyncrl.trainer.loop import accounting_line

        try:
            counts = await asyncio.wait_for(parts.buffer.metrics.remote(), CLOSE_S)
            rollouts = parts.rollouts.counters.metrics()
            log.info("stopped at policy version %s; buffer %s; rollouts %s",
                     getattr(self._trainer, "version", None),
                     accounting_line(counts),
                     " ".join(f"{k.removeprefix('rollout/')}={v:g}" for k, v in rollouts.items()))
            await asyncio.wait_for(parts.close(), CLOSE_S)
        except Exception as err:  # noqa: BLE001 - shutting down: report, never raise out of Serve's destructor
            log.warning("closing the trainer's parts: %r", err)

    async def check_health(self) -> None:
        # A failed loop stays visible in /train/status instead of being restarted in a loop;
        # only an unexpected cancellation of the task is unhealthy.
        if self._task.cancelled():
            raise RuntimeError("training loop task was cancelled")


def build_app(
    cfg: RootConfig,
    *,
    train: bool = True,
    weight_source: str | None = WEIGHT_STORE_NAME,
    weight_source_namespace: str | None = WEIGHT_STORE_NAMESPACE,
    status_actor: str | None = None,
    status_namespace: str | None = None,
) -> serve.Application:
    """The one application graph, with or without training.

    `train` (the full app, `deploy/rlhf*.yaml`): engines <- trainer, engines <- gateway; the
    gateway is the HTTP ingress and answers `/train/status` from the trainer. Without (the
    generator alone, `deploy/generator.yaml`): engines <- gateway; `/train/status` comes from
    `status_actor` when one is named. Late engine replicas load from `weight_source`."""
    if train:
        from asyncrl.trainer.checks import check_trainable
        from asyncrl.trainer.placement_choice import resolve_placement

        check_trainable(cfg)
        cfg = resolve_placement(cfg)  # hybrid.enabled: auto -> true / false, with its reason logged
        from asyncrl.trainer.layout_advice import advised_config, log_layout_advice

        # a GPU learner: the layout estimated fastest that fits, against the configured one (taken with layout: advised)
        cfg = advised_config(cfg, log_layout_advice(cfg))
        check_live_cluster(cfg)  # a pool no node offers fails here, not as a replica pending for ever
    if cfg.generator.tool_parser is not None:  # a name vLLM does not know is a config error here, not a 400 later
        from asyncrl.generator.vllm_engine import tool_parser_class

        tool_parser_class(cfg.generator.tool_parser)
    # Replicas may run with another working directory: pin the model path now.
    model = cfg.model.model_copy(update={"path": str(Path(cfg.model.path).resolve())})
    cfg = cfg.model_copy(update={"model": model})
    model_d, gen_d = model.model_dump(), cfg.generator.model_dump()
    engine = GeneratorEngine.options(**engine_deployment_options(cfg.generator)).bind(
        model_d, gen_d, weight_source, weight_source_namespace)
    trainer = None
    if train:
        trainer = TrainerDeployment.options(
            ray_actor_options={"num_cpus": TRAINER_NUM_CPUS, **cfg.trainer.pool.actor_options()},
        ).bind(cfg.model_dump(mode="json"), engine)
    gen = cfg.generator
    return GeneratorGateway.options(
        ray_actor_options={"num_cpus": GATEWAY_NUM_CPUS, **gen.gateway_pool.actor_options()},
        # The gateway only awaits; its own limit must not be the bottleneck in front of the engines,
        # whose max_ongoing/max_queued decide overload (503).
        max_ongoing_requests=max(1000, 2 * gen.autoscaling.max_replicas * gen.max_ongoing_requests + max(gen.max_queued_requests, 0)),
    ).bind(engine, model_d, gen_d, status_actor, status_namespace, status_source=trainer)


def app_builder(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve YAML entry point of the full app: `args` is the RootConfig mapping."""
    return build_app(load_config(dict(args or {}), source="serve args"))


def generator_app_builder(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve YAML entry point of the generator alone: `args` is the RootConfig mapping, optionally
    with the top-level keys of `GENERATOR_EXTRA_KEYS`, which are not config sections."""
    args = dict(args or {})
    extras = {k: args.pop(k) for k in GENERATOR_EXTRA_KEYS if k in args}
    return build_app(load_config(args, source="serve args"), train=False, **extras)


def run_generator(cfg: RootConfig, *, name: str = "generator", route_prefix: str = "/", **kwargs: Any) -> Any:
    """Start Serve's HTTP proxy on generator.http_host/port and deploy the generator alone (for
    scripts and tests); returns the gateway handle. `kwargs` as `build_app`'s."""
    serve.start(http_options={"host": cfg.generator.http_host, "port": cfg.generator.http_port})
    return serve.run(build_app(cfg, train=False, **kwargs), name=name, route_prefix=route_prefix)
