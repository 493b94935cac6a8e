"""Build the generator Serve application (engine deployment + HTTP gateway) from the root config.

Owns: binding `GeneratorEngine` (options from GeneratorConfig) under `GeneratorGateway`, the
Serve YAML entry point `app_builder(args)`, and `run_generator` for scripts and tests.

Must never: start Ray itself (Serve or the caller does) or hand a component more than its own
config sections.

Serve YAML (`deploy/generator.yaml`): `import_path: asyncrl.generator.app:app_builder`, `args` =
the RootConfig mapping, optionally with three extra top-level keys that are not config sections:
`weight_source` / `weight_source_namespace` (the WeightStore actor late replicas load from;
default `asyncrl_weight_store` in namespace `asyncrl`) and `status_actor` (the training loop's
status actor behind `GET /train/status`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve

from asyncrl.config import RootConfig, load_config
from asyncrl.generator.deployment import GeneratorEngine, engine_deployment_options
from asyncrl.generator.gateway import GeneratorGateway
from asyncrl.weightsync.store import STORE_NAME as WEIGHT_STORE_NAME
from asyncrl.weightsync.store import STORE_NAMESPACE as WEIGHT_STORE_NAMESPACE

_EXTRA_KEYS = ("weight_source", "weight_source_namespace", "status_actor", "status_namespace")


def build_generator_app(
    cfg: RootConfig,
    *,
    weight_source: str | None = WEIGHT_STORE_NAME,
    weight_source_namespace: str | None = WEIGHT_STORE_NAMESPACE,
    status_actor: str | None = None,
    status_namespace: str | None = None,
    gateway_num_cpus: float = 0.1,
) -> serve.Application:
    # Replicas may run with another working directory: pin the model path now.
    model = cfg.model.model_copy(update={"path": str(Path(cfg.model.path).resolve())})
    model_d, gen_d = model.model_dump(), cfg.generator.model_dump()
    engine = GeneratorEngine.options(**engine_deployment_options(cfg.generator)).bind(
        model_d, gen_d, weight_source, weight_source_namespace
    )
    gen = cfg.generator
    gateway = GeneratorGateway.options(
        ray_actor_options={"num_cpus": gateway_num_cpus, **gen.gateway_pool.actor_options()},
        # The gateway only awaits; its own limit must not be the bottleneck in front of the engines,
        # whose max_ongoing/max_queued decide overload (503).
        max_ongoing_requests=max(1000, 2 * gen.autoscaling.max_replicas * gen.max_ongoing_requests + max(gen.max_queued_requests, 0)),
    ).bind(engine, model_d, gen_d, status_actor, status_namespace)
    return gateway


def app_builder(args: dict[str, Any] | None = None) -> serve.Application:
    """`serve run` entry point: args = RootConfig mapping (+ optional keys in _EXTRA_KEYS)."""
    args = dict(args or {})
    extras = {k: args.pop(k) for k in _EXTRA_KEYS if k in args}
    cfg = load_config(args, source="serve args")
    return build_generator_app(cfg, **extras)


def run_generator(cfg: RootConfig, *, name: str = "generator", route_prefix: str = "/", **kwargs: Any) -> Any:
    """Start Serve's HTTP proxy on generator.http_host/port and deploy the app; returns the gateway handle."""
    serve.start(http_options={"host": cfg.generator.http_host, "port": cfg.generator.http_port})
    return serve.run(build_generator_app(cfg, **kwargs), name=name, route_prefix=route_prefix)
