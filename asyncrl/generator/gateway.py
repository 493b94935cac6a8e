"""The HTTP gateway: one FastAPI ingress in front of the engine deployment, for people and programs.

Owns: the Serve deployment (`GeneratorGateway`) and its FastAPI app: the token-level `/generate` route (streamed as
NDJSON `CompletionDelta` lines, then a final `{"done": true, "versions": [...]}` line; the body's per-token versions
are authoritative), health/metrics/train-status, the admin routes (bearer token), and the OpenAI-compatible routes
of `openai_api.py`. Parsing, limits and error mapping live in `gateway_core.py`.
Must never: forward a request that failed validation, hang when the engines are saturated (Serve's
BackPressureError becomes 503), or open admin routes without a configured token.
Details: docs/design/generator.md, "The HTTP gateway".
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.generator.control import ReplicaControlError
from asyncrl.generator.deployment import freeze_heap
from asyncrl.generator.gateway_core import (
    GATEWAY_DEPLOYMENT,
    VERSION_HEADER,
    GatewayCore,
    GenerateBody,
    HTTPError,
    engine_error_to_http,
    error_response,
    parse_model,
    prompt_ids_of,
    read_json,
    result_to_json,
    sampling_from_body,
    version_header,
)
from asyncrl.generator.metrics import render_training
from asyncrl.generator.openai_api import register_openai_routes
from asyncrl.interfaces import EngineAPI
from asyncrl.types import CompletionDelta, GenerationRequest


def create_app(core: GatewayCore) -> FastAPI:
    app = FastAPI(title="asyncrl generator", docs_url=None, redoc_url=None)
    max_bytes = core.gen_cfg.max_body_bytes

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, err: HTTPError) -> JSONResponse:
        return error_response(err, request.url.path.startswith("/v1/"))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        t0 = time.monotonic()
        core.metrics.in_flight.inc()
        status, tokens, streaming = 500, 0, False
        try:
            body = parse_model(GenerateBody, await read_json(request, max_bytes))
            ids = prompt_ids_of(core, body)
            req = GenerationRequest(prompt_ids=ids, sampling=sampling_from_body(body), **({"request_id": body.request_id} if body.request_id else {}))
            if body.stream:
                first, rest = await core.stream(req)
                streaming = True  # the stream's own finally records it
                return _ndjson_stream(core, first, rest, t0)
            result = await core.generate(req)
            tokens = sum(len(c.token_ids) for c in result.completions)
            status = 200
            return JSONResponse(result_to_json(result), headers={VERSION_HEADER: version_header(result.versions)})
        except HTTPError as err:
            status = err.status
            raise
        finally:
            if not streaming:
                core.metrics.in_flight.dec()
                core.metrics.observe("/generate", status, time.monotonic() - t0, tokens)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await core.replica_stats()
        body = core.metrics.render(stats) + render_training(await core.training_metrics())
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/train/status")
    async def train_status() -> Any:
        return await core.train_status()

    _register_admin(app, core, max_bytes)
    register_openai_routes(app, core)
    return app


def _ndjson_stream(core: GatewayCore, first: list[CompletionDelta], rest: AsyncIterator, t0: float) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        versions: set[int] = set()
        tokens, status = 0, 200
        try:
            chunk = first
            while True:
                for d in chunk:
                    versions.update(d.versions)
                    tokens += len(d.token_ids)
                    yield msgspec.json.encode(d) + b"\n"
                try:
                    chunk = await rest.__anext__()
                except StopAsyncIteration:
                    break
            yield json.dumps({"done": True, "versions": sorted(versions)}).encode() + b"\n"
        except Exception as err:
            status = engine_error_to_http(err).status
            yield json.dumps({"error": str(err), "status": status}).encode() + b"\n"
        finally:
            core.metrics.in_flight.dec()
            core.metrics.observe("/generate", status, time.monotonic() - t0, tokens)

    first_versions = {v for d in first for v in d.versions}
    return StreamingResponse(body(), media_type="application/x-ndjson", headers={VERSION_HEADER: version_header(first_versions)})


def _register_admin(app: FastAPI, core: GatewayCore, max_bytes: int) -> None:
    async def _body(request: Request) -> dict[str, Any]:
        if request.headers.get("content-length") in (None, "0"):
            return {}
        data = await read_json(request, max_bytes)
        if not isinstance(data, dict):
            raise HTTPError(422, "admin request body must be a JSON object")
        return data

    async def _broadcast(verb: Callable[..., Any], *args: Any) -> JSONResponse:
        try:
            results = await core.control.call(verb, *args)
        except ReplicaControlError as err:
            return JSONResponse({"detail": str(err), "failures": err.failures,
                                 "results": msgspec.to_builtins(err.results)}, status_code=502)
        results = msgspec.to_builtins(results)  # (typed answers, e.g. abort_update's, as JSON objects)
        versions = [r["version"] for r in results.values() if isinstance(r, dict) and "version" in r]
        return JSONResponse({"replicas": results}, headers={VERSION_HEADER: version_header(versions)} if versions else None)

    @app.post("/admin/pause")
    async def pause(request: Request) -> JSONResponse:
        core.require_admin(request)
        mode = (await _body(request)).get("mode", "keep")
        if mode not in ("abort", "wait", "keep"):
            raise HTTPError(422, f"mode must be abort|wait|keep, got {mode!r}")
        return await _broadcast(EngineAPI.pause, mode)

    @app.post("/admin/resume")
    async def resume(request: Request) -> JSONResponse:
        core.require_admin(request)
        return await _broadcast(EngineAPI.resume)

    @app.post("/admin/sleep")
    async def sleep(request: Request) -> JSONResponse:
        core.require_admin(request)
        level = (await _body(request)).get("level", 1)
        if type(level) is not int or level not in (1, 2):  # not True (== 1 in Python) nor 1.0
            raise HTTPError(422, f"level must be 1 or 2, got {level!r}")
        return await _broadcast(EngineAPI.sleep, level)

    @app.post("/admin/wake")
    async def wake(request: Request) -> JSONResponse:
        """Body `{"tags": ["weights"]}` wakes part of the engine (weights before KV cache); none wakes all."""
        core.require_admin(request)
        tags = (await _body(request)).get("tags")
        if tags is not None and (not isinstance(tags, list) or not tags
                                 or not all(isinstance(t, str) and t in ("weights", "kv_cache") for t in tags)):
            raise HTTPError(422, f"tags must be a non-empty list of 'weights' and 'kv_cache', got {tags!r}")
        return await _broadcast(EngineAPI.wake_up, tags)

    @app.post("/admin/sync_weights")
    async def sync_weights(request: Request) -> JSONResponse:
        """Every replica pulls the WeightStore's latest version if it is newer than its own."""
        core.require_admin(request)
        return await _broadcast(EngineAPI.sync_from_source)

    @app.post("/admin/abort_update")
    async def abort_update(request: Request) -> JSONResponse:
        core.require_admin(request)
        return await _broadcast(EngineAPI.abort_update)

    @app.get("/admin/stats")
    async def stats(request: Request) -> JSONResponse:
        core.require_admin(request)
        resp = await _broadcast(EngineAPI.stats)
        return resp


@serve.deployment(name=GATEWAY_DEPLOYMENT)
@serve.ingress()
class GeneratorGateway:
    """Thin Serve wrapper: builds `GatewayCore` and hands Serve the FastAPI app (and, with
    generator.direct_http_port, serves the same app itself on that port: ingress.py)."""

    async def __init__(
        self,
        engine: Any,
        model: dict[str, Any],
        generator: dict[str, Any],
        status_actor: str | None = None,
        status_namespace: str | None = None,
        status_source: Any = None,
    ) -> None:
        gen = GeneratorConfig.model_validate(generator)
        self.core = GatewayCore(
            engine,
            ModelConfig.model_validate(model),
            gen,
            status_actor=status_actor,
            status_namespace=status_namespace,
            status_source=status_source,
        )
        self.direct = None
        if gen.direct_http_port is not None:
            from asyncrl.generator.ingress import DirectIngress

            self.direct = DirectIngress(create_app(self.core), gen.http_host, gen.direct_http_port)
            await self.direct.start()
        freeze_heap()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self.core)

    def __del__(self) -> None:
        direct = getattr(self, "direct", None)
        if direct is not None:
            direct.stop()
