"""The gateway's core: what every HTTP route of the generator shares, without the routes.

Owns: `GatewayCore` (request parsing and limits: body size, sampling ranges, context length;
the engine handle and control fan-out; the episode ledger; metrics), `HTTPError` and the mapping
of engine errors to HTTP statuses (bad input 4xx, overload 503 + Retry-After), the
`x-asyncrl-weight-version` header, and the request/response shapes of the token-level
`/generate` API. The routes live in `gateway.py` (native and admin) and `openai_api.py`
(OpenAI-compatible); both import this module and neither imports the other.

Must never: forward a request that failed validation, or register a route.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncrl.config import GeneratorConfig, ModelConfig
from asyncrl.generator.control import EngineControl, ReplicaControlError
from asyncrl.generator.episodes import EpisodeLedger
from asyncrl.generator.metrics import GatewayMetrics
from asyncrl.generator.replica_types import replica_unavailable
from asyncrl.generator.sampling import Limits, RequestError, validate_request
from asyncrl.types import CompletionDelta, GenerationRequest, GenerationResult, SamplingParams

VERSION_HEADER = "x-asyncrl-weight-version"
GATEWAY_DEPLOYMENT = "GeneratorGateway"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def version_header(versions: list[int] | set[int]) -> str:
    return ",".join(str(v) for v in sorted(set(versions)))


def _unwrap(err: BaseException) -> list[BaseException]:
    chain, seen = [], 0
    while err is not None and seen < 6:
        chain.append(err)
        err = getattr(err, "cause", None) or err.__cause__
        seen += 1
    return chain


# A request that met a replica not serving (starting, or its engine dead and the replica being replaced) produced
# nothing: it goes to the router again, this many times in all, the waits doubling from UNAVAILABLE_RETRY_S (0.5,
# 1, 2 s: past the engine deployment's 2 s health check, after which the router no longer picks that replica)
UNAVAILABLE_ATTEMPTS, UNAVAILABLE_RETRY_S = 4, 0.5


def engine_error_to_http(err: BaseException) -> HTTPError:
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from asyncrl.generator.replica_types import ReplicaNotReady

    for e in _unwrap(err):
        if isinstance(e, HTTPError):
            return e
        if isinstance(e, RequestError):
            return HTTPError(e.status, str(e))
        if isinstance(e, BackPressureError):
            return HTTPError(503, "generator overloaded: request queue is full, retry later", {"Retry-After": "1"})
        if isinstance(e, (DeploymentUnavailableError, ReplicaNotReady)):
            return HTTPError(503, f"generator unavailable: {e}", {"Retry-After": "5"})
    return HTTPError(500, f"generation failed: {type(err).__name__}: {err}")


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON; 413 past `max_bytes` (declared or actual), 400 if not JSON."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > max_bytes:
                raise HTTPError(413, f"request body of {declared} bytes exceeds generator.max_body_bytes={max_bytes}")
        except ValueError:
            raise HTTPError(400, f"invalid Content-Length {declared!r}") from None
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HTTPError(413, f"request body exceeds generator.max_body_bytes={max_bytes}")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HTTPError(400, f"request body is not valid JSON: {err}") from None


def parse_model(model: type[BaseModel], data: Any, status: int = 422) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        parts = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors()]
        raise HTTPError(status, "invalid request: " + "; ".join(parts)) from None


class GenerateBody(BaseModel):
    """`POST /generate`: exactly one of prompt_ids / prompt / messages, plus sampling options.

    `prompt` is raw text, tokenized as is (no chat template); `messages` is a chat (`[{"role":
    "user", "content": "..."}]`, as /v1/chat/completions takes it) rendered with the model's chat
    template, ready for the assistant's turn."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt_ids: list[int] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    logprobs: bool | int = True
    ignore_eos: bool = False
    stream: bool = False
    request_id: str | None = None


class GatewayCore:
    """Everything the routes need, apart from FastAPI: tokenizer, limits, engine calls, metrics."""

    def __init__(
        self,
        engine: Any,
        model: ModelConfig,
        gen: GeneratorConfig,
        *,
        status_actor: str | None = None,
        status_namespace: str | None = None,
        status_source: Any = None,
    ) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.engine, self.model_cfg, self.gen_cfg = engine, model, gen
        self.tokenizer = AutoTokenizer.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
        hf_config = AutoConfig.from_pretrained(model.path, trust_remote_code=model.trust_remote_code)
        vocab = int(getattr(hf_config, "vocab_size", None) or len(self.tokenizer))
        self.limits = Limits(max_n=gen.max_n, max_model_len=model.max_model_len, vocab_size=vocab)
        self.metrics = GatewayMetrics()
        self.control = EngineControl(engine)
        self._stream_handle = engine.options(stream=True)
        self.admin_token = gen.resolved_admin_token()
        self.status_actor, self.status_namespace = status_actor, status_namespace
        self.status_source = status_source  # a Serve handle (the trainer deployment) with status()
        self.episodes = EpisodeLedger(max_turns=gen.episode_max_turns, max_tokens=gen.episode_max_tokens,
                                      idle_timeout_s=gen.episode_idle_timeout_s)
        self.tool_parser: Any = None  # vLLM's ToolParser class for chat completions with tools
        if gen.tool_parser is not None:
            from asyncrl.generator.vllm_engine import tool_parser_class

            self.tool_parser = tool_parser_class(gen.tool_parser)

    # ---- prompts ---------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` (already `plain_message`s) under the chat template, ending
        where the assistant's answer starts; `tools` (OpenAI function tools) go to the template."""
        if not messages:
            raise HTTPError(400, "messages must be a non-empty list of {role, content} objects")
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # template errors are the caller's messages being malformed
            raise HTTPError(400, f"messages could not be rendered with the chat template: {err}") from None
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- generation ------------------------------------------------------------------------

    def check(self, request: GenerationRequest) -> None:
        try:
            validate_request(request, self.limits)
        except RequestError as err:
            raise HTTPError(err.status, str(err)) from None

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.check(request)
        for attempt in range(UNAVAILABLE_ATTEMPTS):
            try:
                return await self.engine.generate.remote(request)
            except Exception as err:
                if attempt + 1 == UNAVAILABLE_ATTEMPTS or not replica_unavailable(err):
                    raise engine_error_to_http(err) from None
            await asyncio.sleep(UNAVAILABLE_RETRY_S * 2**attempt)
        raise AssertionError("unreachable")

    async def stream(self, request: GenerationRequest) -> tuple[list[CompletionDelta], AsyncIterator[list[CompletionDelta]]]:
        """(first chunk, rest). The first chunk is awaited here so errors become statuses, not broken streams."""
        self.check(request)
        for attempt in range(UNAVAILABLE_ATTEMPTS):
            gen = self._stream_handle.generate_stream.remote(request)
            try:
                return await gen.__anext__(), gen
            except StopAsyncIteration:
                return [], gen
            except Exception as err:
                if attempt + 1 == UNAVAILABLE_ATTEMPTS or not replica_unavailable(err):
                    raise engine_error_to_http(err) from None
            await asyncio.sleep(UNAVAILABLE_RETRY_S * 2**attempt)
        raise AssertionError("unreachable")

    # ---- admin / status --------------------------------------------------------------------

    def require_admin(self, request: Request) -> None:
        if not self.admin_token:
            raise HTTPError(403, "admin routes are closed: no generator.admin_token / $ASYNCRL_ADMIN_TOKEN configured")
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.admin_token.encode()):
            raise HTTPError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    async def replica_stats(self) -> dict[str, Any]:
        try:
            return await self.control.stats()
        except ReplicaControlError as err:
            return err.results
        except Exception:
            return {}

    async def training_metrics(self) -> dict[str, Any]:
        """The loop's latest step metrics for /metrics; empty without a loop (never an error)."""
        try:
            status = await self.train_status()
        except Exception:
            return {}
        return status.get("metrics", {}) if isinstance(status, dict) else {}

    async def train_status(self) -> Any:
        if self.status_source is not None:
            try:
                return await self.status_source.status.remote()
            except Exception as err:
                raise HTTPError(503, f"training status unavailable: {type(err).__name__}: {err}") from None
        if not self.status_actor:
            raise HTTPError(503, "no training loop attached")
        import ray

        try:
            actor = ray.get_actor(self.status_actor, namespace=self.status_namespace)
        except ValueError:
            raise HTTPError(503, f"training status actor {self.status_actor!r} not found") from None
        return await actor.status.remote()


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def plain_message(m: Any, index: int = 0) -> dict[str, Any]:
    """One chat message as the chat template wants it: `{"role", "content"}` with text content, plus
    an assistant's `tool_calls` (their JSON `arguments` parsed into objects, as chat templates
    render them) and a tool result's `tool_call_id`.

    Takes a dict or a pydantic / TypedDict message (vLLM's OpenAI params); content may be a string
    or a list of `{"type": "text", "text": ...}` parts (joined). Anything else is the caller's
    error (400), naming the message's index."""
    d = m.model_dump() if hasattr(m, "model_dump") else dict(m) if isinstance(m, dict) else None
    if d is None:
        raise HTTPError(400, f"messages[{index}] must be an object with role and content, got {type(m).__name__}")
    role = d.get("role")
    if role not in CHAT_ROLES:
        raise HTTPError(400, f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    content = d.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            part = part.model_dump() if hasattr(part, "model_dump") else dict(part) if isinstance(part, dict) else {}
            if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
                raise HTTPError(400, f"messages[{index}]: content part of type {part.get('type')!r} is not supported (text only)")
            texts.append(part.get("text", ""))
        content = "".join(texts)
    if content is not None and not isinstance(content, str):
        raise HTTPError(400, f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}")
    out: dict[str, Any] = {"role": role, "content": content or ""}
    calls = d.get("tool_calls")
    if calls:
        if role != "assistant" or not isinstance(calls, list):
            raise HTTPError(400, f"messages[{index}].tool_calls: only an assistant message has tool_calls, as a list")
        out["tool_calls"] = [_tool_call(c, index, k) for k, c in enumerate(calls)]
    if role == "tool" and d.get("tool_call_id") is not None:
        out["tool_call_id"] = str(d["tool_call_id"])
    return out


def _tool_call(call: Any, index: int, k: int) -> dict[str, Any]:
    """One OpenAI tool call of an assistant message, its `arguments` (a JSON string) as an object."""
    c = call.model_dump() if hasattr(call, "model_dump") else dict(call) if isinstance(call, dict) else {}
    fn = c.get("function")
    fn = fn.model_dump() if hasattr(fn, "model_dump") else fn
    where = f"messages[{index}].tool_calls[{k}]"
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise HTTPError(400, f"{where} must be {{id, type: function, function: {{name, arguments}}}}")
    args = fn.get("arguments")
    if args is None or (isinstance(args, str) and not args.strip()):
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as err:
            raise HTTPError(400, f"{where}.function.arguments is not JSON: {err}") from None
    return {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def prompt_ids_of(core: "GatewayCore", body: GenerateBody) -> list[int]:
    """The prompt of a `/generate` body as token ids, from whichever of the three forms it gave."""
    given = [name for name in ("prompt_ids", "prompt", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise HTTPError(422, "give exactly one of `prompt` (raw text, no chat template), `prompt_ids` (token ids) "
                             f"or `messages` (a chat, rendered with the chat template); got {', '.join(given) or 'none'}")
    if body.prompt_ids is not None:
        return body.prompt_ids
    if body.prompt is not None:
        return core.encode(body.prompt)
    return core.chat_prompt_ids([plain_message(m, i) for i, m in enumerate(body.messages)])


def sampling_from_body(body: GenerateBody) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=body.max_tokens,
        stop=stop, stop_token_ids=list(body.stop_token_ids), seed=body.seed, logprobs=bool(body.logprobs),
        ignore_eos=body.ignore_eos,
    )


def result_to_json(result: GenerationResult) -> dict[str, Any]:
    return {
        "request_id": result.request_id,
        "replica_id": result.replica_id,
        "prompt_ids": result.prompt_ids,
        "versions": result.versions,
        "completions": [msgspec.to_builtins(c) for c in result.completions],
    }


def error_response(err: HTTPError, openai: bool) -> JSONResponse:
    if openai:
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        body: dict[str, Any] = {"error": {"message": err.message, "type": kind, "param": None, "code": err.status}}
    else:
        body = {"detail": err.message}
    return JSONResponse(body, status_code=err.status, headers=err.headers)
