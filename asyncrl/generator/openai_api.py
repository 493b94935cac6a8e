"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models, and the episode routes.

Owns: translating vLLM's OpenAI protocol models (so the official `openai` client works unmodified) to and from our
token-level `GenerationRequest`/`GenerationResult` (every choice carries `token_ids` and `versions`; streams are
SSE), and the /v1/episodes routes (episodes.py keeps the ledger). A chat completion with `x-asyncrl-episode: ID` is
one turn of it (n must be 1; recorded whether or not log-probs were asked; a stream cut short records nothing).
Chat tools work when `generator.tool_parser` names vLLM's parser for the chat template (auto or none; not streamed).
Must never: accept an option it would silently ignore when ignoring changes the output (echo, suffix, beam search,
forced tool choice, streamed tool calls, top-k log-probs beyond the sampled token): those get 400.
Details: docs/design/generator.md, "OpenAI-compatible routes".
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from asyncrl.generator.episodes import EPISODE_HEADER, EpisodeError, Turn
from asyncrl.generator.gateway_core import (
    VERSION_HEADER,
    GatewayCore,
    HTTPError,
    engine_error_to_http,
    parse_model,
    plain_message,
    read_json,
    version_header,
)
from asyncrl.generator.vllm_engine import openai_protocol
from asyncrl.types import Completion, CompletionDelta, GenerationRequest, SamplingParams, finite_number


def parse_tool_calls(parser: Any, tokenizer: Any, text: str, req: Any) -> tuple[str | None, list[Any]]:
    """(content, tool calls) of a sampled `text` by vLLM's tool parser class `parser` for chat request
    `req` (its tools); text without a well-formed call: (text, [])."""
    info = parser(tokenizer, req.tools).extract_tool_calls(text, req)
    return (info.content, list(info.tool_calls)) if info.tools_called and info.tool_calls else (text, [])


def chat_tools(req: Any, parser: Any) -> list[dict[str, Any]] | None:
    """A chat request's tools as the chat template takes them (None without), or a 400 for what the
    gateway cannot honour: tools without a parser (`parser` None), a forced tool choice, streaming."""
    if not req.tools:
        return None
    if parser is None:
        raise HTTPError(400, "tools need generator.tool_parser: vLLM's tool-call parser for this model's chat template "
                             "(e.g. hermes), as `vllm serve --tool-call-parser`")
    choice = req.tool_choice
    if choice not in (None, "auto", "none"):
        named = choice if isinstance(choice, str) else "a named function"
        raise HTTPError(400, f"tool_choice={named}: only auto and none (forcing a call needs structured outputs, which "
                             "this API does not run)")
    if req.stream:
        raise HTTPError(400, "tools with stream=true are not supported: send stream=false")
    return [t.model_dump(exclude_none=True) for t in req.tools]


def finish_body(body: Any, turns: int) -> tuple[float, list[float] | None]:
    """(reward, per-turn rewards or None) of an episode's finish body, `{"reward": r}` or
    `{"reward": r, "turn_rewards": [one per turn]}`, for an episode of `turns` turns; else a 400."""
    usage = '{"reward": <a finite number>, "turn_rewards": [<one finite number per turn>] (optional)}'
    if not isinstance(body, dict) or set(body) - {"reward", "turn_rewards"} or not finite_number(body.get("reward")):
        raise HTTPError(400, f"finish needs {usage}")
    per_turn = body.get("turn_rewards")
    if per_turn is None:
        return float(body["reward"]), None
    if not isinstance(per_turn, list) or not all(finite_number(r) for r in per_turn):
        raise HTTPError(400, f"turn_rewards must be a list of finite numbers: {usage}")
    if len(per_turn) != turns:
        raise HTTPError(400, f"turn_rewards has {len(per_turn)} values for an episode of {turns} turns (one per turn)")
    return float(body["reward"]), [float(r) for r in per_turn]


def _sampling(req: Any, max_tokens: int | None, want_logprobs: bool) -> SamplingParams:
    if req.use_beam_search:
        raise HTTPError(400, "use_beam_search is not supported")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        n=1 if req.n is None else req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        max_tokens=16 if max_tokens is None else max_tokens,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        seed=req.seed,
        logprobs=want_logprobs,
        ignore_eos=bool(req.ignore_eos),
    )


class _Tracked:
    """Metrics bookkeeping for one request; a stream hands it over to its body generator."""

    def __init__(self, core: GatewayCore, route: str) -> None:
        self.core, self.route, self.t0 = core, route, time.monotonic()
        self.status, self.tokens, self.done = 500, 0, False
        core.metrics.in_flight.inc()

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.core.metrics.in_flight.dec()
            self.core.metrics.observe(self.route, self.status, time.monotonic() - self.t0, self.tokens)


def register_openai_routes(app: FastAPI, core: GatewayCore) -> None:
    chat, cmpl, DeltaMessage, ModelCard, ModelList, UsageInfo = openai_protocol()
    served = core.model_cfg.served_name
    max_bytes = core.gen_cfg.max_body_bytes

    def check_model(name: str | None) -> None:
        if name not in (None, "", served, core.model_cfg.path):
            raise HTTPError(404, f"model {name!r} not found; this server serves {served!r}")

    def token_strs(ids: list[int]) -> list[str]:
        """Each token's own text, in one tokenizer call for the whole completion."""
        return core.tokenizer.batch_decode([[t] for t in ids])

    @app.get("/v1/models")
    async def models() -> Any:
        card = ModelCard(id=served, root=core.model_cfg.path, owned_by="asyncrl", max_model_len=core.model_cfg.max_model_len)
        return ModelList(data=[card]).model_dump()

    # ---- completions -----------------------------------------------------------------------

    def completion_logprobs(c: Completion | CompletionDelta, offset: int) -> Any:
        tokens = token_strs(c.token_ids)
        offsets, pos = [], offset
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        return cmpl.CompletionLogProbs(
            tokens=tokens, token_logprobs=list(c.logprobs), text_offset=offsets,
            top_logprobs=[{s: lp} for s, lp in zip(tokens, c.logprobs)],
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        track = _Tracked(core, "/v1/completions")
        try:
            req = parse_model(cmpl.CompletionRequest, await read_json(request, max_bytes), status=400)
            check_model(req.model)
            if req.echo or req.suffix:
                raise HTTPError(400, "echo and suffix are not supported")
            if req.logprobs is not None and not 0 <= req.logprobs <= 1:
                raise HTTPError(400, f"logprobs={req.logprobs}: only the sampled token's log-prob is available (0 or 1)")
            prompt = req.prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = core.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise HTTPError(400, "prompt must be one string or one list of token ids (batches are not supported)")
            want_lp = req.logprobs is not None
            greq = GenerationRequest(prompt_ids=ids, sampling=_sampling(req, req.max_tokens, want_lp))
            if req.stream:
                first, rest = await core.stream(greq)
                include_usage = bool(req.stream_options and req.stream_options.include_usage)

                def event(d: CompletionDelta, offsets: dict[int, int]) -> Any:
                    lp = completion_logprobs(d, offsets.get(d.index, 0)) if want_lp else None
                    offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
                    choice = cmpl.CompletionResponseStreamChoice(
                        index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason, token_ids=d.token_ids,
                    )
                    return {"choices": [{**choice.model_dump(), "versions": d.versions}]}

                return _sse(track, first, rest, event, lambda: cmpl.CompletionStreamResponse(model=served, choices=[]).model_dump(),
                            len(ids), include_usage, UsageInfo)
            result = await core.generate(greq)
            choices = []
            for c in result.completions:
                lp = completion_logprobs(c, 0) if want_lp else None
                choice = cmpl.CompletionResponseChoice(index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason, token_ids=c.token_ids)
                choices.append({**choice.model_dump(), "versions": c.versions})
            n_out = sum(len(c.token_ids) for c in result.completions)
            track.status, track.tokens = 200, n_out
            body = cmpl.CompletionResponse(model=served, choices=[], usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=n_out,
                                                                                     total_tokens=len(ids) + n_out)).model_dump()
            body["choices"] = choices
            return JSONResponse(body, headers={VERSION_HEADER: version_header(result.versions)})
        except HTTPError as err:
            track.status = err.status
            raise
        finally:
            if not getattr(track, "streaming", False):
                track.finish()

    # ---- chat ------------------------------------------------------------------------------

    def chat_logprobs(c: Completion | CompletionDelta, top: int) -> Any:
        content = []
        for s, lp in zip(token_strs(c.token_ids), c.logprobs):
            tops = [chat.ChatCompletionLogProb(token=s, logprob=lp, bytes=list(s.encode()))] if top else []
            content.append(chat.ChatCompletionLogProbsContent(token=s, logprob=lp, bytes=list(s.encode()), top_logprobs=tops))
        return chat.ChatCompletionLogProbs(content=content)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        track = _Tracked(core, "/v1/chat/completions")
        try:
            req = parse_model(chat.ChatCompletionRequest, await read_json(request, max_bytes), status=400)
            check_model(req.model)
            tools = chat_tools(req, core.tool_parser)
            tools_req = req if tools is not None and req.tool_choice != "none" else None  # parse its tool calls
            top = req.top_logprobs or 0
            if top > 1:
                raise HTTPError(400, f"top_logprobs={top}: only the sampled token's log-prob is available (0 or 1)")
            messages = [plain_message(m, i) for i, m in enumerate(req.messages)]
            ids = core.chat_prompt_ids(messages, tools)
            want_lp = bool(req.logprobs)
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            if max_tokens is None:  # OpenAI chat default: as long as the context allows
                max_tokens = max(1, core.model_cfg.max_model_len - len(ids))
            episode = request.headers.get(EPISODE_HEADER)
            if episode is not None:
                return await episode_turn(track, episode, req, ids, max_tokens, top, tools_req)
            greq = GenerationRequest(prompt_ids=ids, sampling=_sampling(req, max_tokens, want_lp))
            if req.stream:
                first, rest = await core.stream(greq)
                return chat_sse(track, req, first, rest, len(ids), top)
            result = await core.generate(greq)
            return chat_response(track, result, ids, want_lp, top, tools_req=tools_req)
        except HTTPError as err:
            track.status = err.status
            raise
        finally:
            if not getattr(track, "streaming", False):
                track.finish()

    def chat_sse(track: _Tracked, req: Any, first: list[CompletionDelta], rest: AsyncIterator, prompt_tokens: int,
                 top: int, headers: dict[str, str] | None = None) -> StreamingResponse:
        """A streamed chat completion: one event per delta (its text, and its log-probs where asked)."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_lp = bool(req.logprobs)
        started: set[int] = set()

        def event(d: CompletionDelta, _offsets: dict[int, int]) -> Any:
            delta = DeltaMessage(content=d.text)
            if d.index not in started:
                started.add(d.index)
                delta = DeltaMessage(role="assistant", content=d.text)
            lp = chat_logprobs(d, top) if want_lp else None
            choice = chat.ChatCompletionResponseStreamChoice(
                index=d.index, delta=delta, logprobs=lp, finish_reason=d.finish_reason, token_ids=d.token_ids,
            )
            return {"choices": [{**choice.model_dump(), "versions": d.versions}]}

        return _sse(track, first, rest, event, lambda: chat.ChatCompletionStreamResponse(model=served, choices=[]).model_dump(),
                    prompt_tokens, include_usage, UsageInfo, headers)

    def chat_message(c: Completion | CompletionDelta, tools_req: Any) -> tuple[Any, str | None]:
        """The assistant message of a choice and its finish reason: with `tools_req`, the tool calls
        vLLM's parser finds in the text (then finish_reason tool_calls, as vLLM's server says)."""
        if tools_req is not None:
            content, calls = parse_tool_calls(core.tool_parser, core.tokenizer, c.text, tools_req)
            if calls:
                return chat.ChatMessage(role="assistant", content=content, tool_calls=calls), "tool_calls"
        return chat.ChatMessage(role="assistant", content=c.text), c.finish_reason

    def chat_response(track: _Tracked, result: Any, ids: list[int], want_lp: bool, top: int,
                      headers: dict[str, str] | None = None, tools_req: Any = None) -> JSONResponse:
        choices = []
        for c in result.completions:
            lp = chat_logprobs(c, top) if want_lp else None
            message, finish = chat_message(c, tools_req)
            choice = chat.ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=lp, finish_reason=finish, token_ids=c.token_ids,
            )
            choices.append({**choice.model_dump(), "versions": c.versions})
        n_out = sum(len(c.token_ids) for c in result.completions)
        track.status, track.tokens = 200, n_out
        body = chat.ChatCompletionResponse(model=served, choices=[], usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=n_out,
                                                                                     total_tokens=len(ids) + n_out)).model_dump()
        body["choices"] = choices
        return JSONResponse(body, headers={VERSION_HEADER: version_header(result.versions), **(headers or {})})

    # ---- episodes --------------------------------------------------------------------------

    def ledger_call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except EpisodeError as err:
            raise HTTPError(err.status, err.message) from None

    async def episode_turn(track: _Tracked, episode: str, req: Any, ids: list[int], max_tokens: int, top: int,
                           tools_req: Any = None) -> Response:
        """One turn of `episode`: the log-probs are always asked for (the trajectory needs them) and
        returned to the client only if it asked. Tool calls in it are parsed as outside an episode;
        the trajectory keeps the sampled tokens as they are. A streamed turn is recorded once its
        stream ended with the completion's last token; one cut short (the client went away, the
        engine failed) records nothing, as a failed turn."""
        if req.n not in (None, 1):
            raise HTTPError(400, f"{EPISODE_HEADER}: n={req.n}; one episode is one trajectory (open one episode per sample)")
        greq = GenerationRequest(prompt_ids=ids, sampling=_sampling(req, max_tokens, True))
        pinned = core.episodes.temperature(episode)
        if req.temperature is None and pinned is not None:  # a trainer's episode: the learner's temperature
            greq.sampling.temperature = pinned
        core.check(greq)  # a bad request is refused before it takes the episode's turn
        ledger_call(core.episodes.begin_turn, episode, ids, max_tokens, greq.sampling.temperature)
        if req.stream:
            try:
                first, rest = await core.stream(greq)
            except BaseException:
                core.episodes.end_turn(episode, None)
                raise
            return chat_sse(track, req, first, _recording_turn(episode, ids, first, rest), len(ids), top,
                            {EPISODE_HEADER: episode})
        turn = None
        try:
            result = await core.generate(greq)
            c = result.completions[0]
            turn = Turn(tuple(ids), tuple(c.token_ids), tuple(c.logprobs), tuple(c.versions))
        finally:
            core.episodes.end_turn(episode, turn)
        return chat_response(track, result, ids, bool(req.logprobs), top, {EPISODE_HEADER: episode}, tools_req=tools_req)

    def _recording_turn(episode: str, ids: list[int], first: list[CompletionDelta], rest: AsyncIterator) -> AsyncIterator:
        """`rest`, passed through, recording the turn's tokens, log-probs and versions (`first`'s too);
        the turn is ended when the stream is (recorded only if its last delta came)."""
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        done = [False]

        def take(chunk: list[CompletionDelta]) -> None:
            for d in chunk:
                tokens.extend(d.token_ids)
                logprobs.extend(d.logprobs)
                versions.extend(d.versions)
                done[0] = done[0] or d.finish_reason is not None

        async def passed() -> AsyncIterator:
            try:
                while True:
                    try:
                        chunk = await rest.__anext__()
                    except StopAsyncIteration:
                        break
                    take(chunk)
                    yield chunk
            finally:
                core.episodes.end_turn(episode, Turn(tuple(ids), tuple(tokens), tuple(logprobs), tuple(versions))
                                       if done[0] else None)

        take(first)
        return passed()

    @app.post("/v1/episodes", status_code=201)
    async def open_episode(request: Request) -> Any:
        raw = await request.body()
        body = await read_json(request, max_bytes) if raw.strip() else {}
        temperature = body.get("temperature") if isinstance(body, dict) else None
        if (not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict) or set(body) - {"metadata", "temperature"}
                or (temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                                 or not 0 <= temperature <= 100))):
            raise HTTPError(400, 'the body is optional: {"metadata": {...}, "temperature": t} (metadata kept with the '
                                 'episode; temperature: every turn must sample at it)')
        return JSONResponse(core.episodes.open(body.get("metadata"), None if temperature is None else float(temperature)),
                            status_code=201)

    @app.get("/v1/episodes")
    async def episode_stats() -> Any:
        core.episodes.reap()
        return core.episodes.stats()

    @app.get("/v1/episodes/{episode}")
    async def describe_episode(episode: str) -> Any:
        return ledger_call(core.episodes.describe, episode)

    @app.post("/v1/episodes/{episode}/finish")
    async def finish_episode(episode: str, request: Request) -> Any:
        body = await read_json(request, max_bytes)
        turns = ledger_call(core.episodes.describe, episode)["turns"]  # no await until finish: it cannot change
        reward, turn_rewards = finish_body(body, turns)
        samples, mismatches, metadata = ledger_call(core.episodes.finish, episode)
        out, at = [], 0
        for sample in samples:  # a split episode's per-turn rewards go with the sample that holds their turns
            js = sample.as_json()
            if turn_rewards is not None:
                js["turn_rewards"] = turn_rewards[at: at + sample.turns]
            at += sample.turns
            out.append(js)
        return {"id": episode, "reward": reward, "turn_rewards": turn_rewards, "metadata": metadata,
                "mismatches": mismatches, "samples": out}


def _sse(track: _Tracked, first: list[CompletionDelta], rest: AsyncIterator, event, envelope, prompt_tokens: int, include_usage: bool, UsageInfo,
         headers: dict[str, str] | None = None) -> StreamingResponse:
    track.streaming = True  # the body generator finishes the bookkeeping
    base = envelope()  # same id/created for every chunk of this stream

    async def body() -> AsyncIterator[bytes]:
        offsets: dict[int, int] = {}
        try:
            chunk = first
            while True:
                for d in chunk:
                    track.tokens += len(d.token_ids)
                    yield b"data: " + json.dumps({**base, **event(d, offsets)}).encode() + b"\n\n"
                try:
                    chunk = await rest.__anext__()
                except StopAsyncIteration:
                    break
            if include_usage:
                usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=track.tokens, total_tokens=prompt_tokens + track.tokens)
                yield b"data: " + json.dumps({**base, "choices": [], "usage": usage.model_dump()}).encode() + b"\n\n"
            track.status = 200
            yield b"data: [DONE]\n\n"
        except Exception as err:
            http = engine_error_to_http(err)
            track.status = http.status
            error = {"error": {"message": http.message, "type": "server_error", "code": http.status}}
            yield b"data: " + json.dumps(error).encode() + b"\n\n"
        finally:
            track.finish()
            if inspect.isasyncgen(rest):  # ours (an episode's turn, recorded as it ends): end it now, not at its GC
                await rest.aclose()

    versions = {v for d in first for v in d.versions}
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={VERSION_HEADER: version_header(versions), **(headers or {})})
