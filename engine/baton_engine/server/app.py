"""The FastAPI application: OpenAI endpoints, health, readiness and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from baton_engine import contract
from baton_engine.core.sampling_params import SamplingParams
from baton_engine.server import errors
from baton_engine.server.engine_client import EngineDeadError
from baton_engine.server.errors import APIError, bad_request
from baton_engine.server.generation import ChoiceDelta, DeadlineExceeded, Generation
from baton_engine.server.openai_format import chat_logprobs, completion_logprobs, now
from baton_engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestGrammar,
    chat_messages,
    decode_body,
    parse,
    prompt_parts,
    request_grammar,
    shown,
    stop_list,
)
from baton_engine.server.state import ServerState
from baton_engine.server.tool_calls import StreamingToolParser, ToolCall, parse_tool_calls
from baton_engine.structured.grammar import ToolCallFormat, tool_call_format

log = logging.getLogger("baton_engine.server")
REQUEST_ID_HEADER = "X-Request-Id"
RETRY_AFTER_SECONDS = 1
SMALL_BODY_BYTES = 64 * 1024
"""Bodies up to this size are parsed and tokenized on the event loop (microseconds); larger
ones in the preprocessing thread, so that a 10 MB body never stalls ``/health`` or a stream."""


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="Baton engine", docs_url=None, redoc_url=None)
    app.state.baton = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        response = exc.response()
        request_id = getattr(request.state, "request_id", None)
        if request_id:
            response.headers[REQUEST_ID_HEADER] = request_id
        log.info("request %s: %d %s", request_id, exc.status, exc.message)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing errors (no such path, wrong method) in OpenAI's shape like every other error."""
        where = f"{request.method} {shown(request.url.path)}"
        if exc.status_code == 404:
            error = APIError(404, f"no such endpoint: {where}", code="not_found")
        elif exc.status_code == 405:
            allowed = next((v for k, v in (exc.headers or {}).items() if k.lower() == "allow"), "")
            error = APIError(
                405,
                f"method not allowed: {where} (allowed: {allowed})",
                code="method_not_allowed",
                headers={"Allow": allowed},
            )
        else:
            error = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return error.response()

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        log.exception("request %s: internal error", request_id)
        error = APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")
        response = error.response()
        if request_id:
            response.headers[REQUEST_ID_HEADER] = request_id
        return response

    @app.get(contract.PATH_HEALTH)
    async def health() -> JSONResponse:
        dead = state.client.dead if state.client is not None else None
        if dead:
            return JSONResponse({"status": "engine dead", "detail": dead}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(contract.PATH_READY)
    async def ready() -> JSONResponse:
        if state.draining:
            return JSONResponse({"ready": False, "reason": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"ready": False, "reason": state.load_error or "loading"}, status_code=503)
        dead = state.client.dead if state.client is not None else "no engine core"
        if dead:  # asked of the process itself, not of the watchdog: not ready the moment it is gone
            return JSONResponse({"ready": False, "reason": f"engine dead: {dead}"}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get(contract.PATH_METRICS)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        _require_ready(state, allow_draining=True)
        data = [
            {
                "id": state.model_name,
                "object": "model",
                "created": now(),
                "owned_by": "baton",
                "max_model_len": state.max_model_len,
            }
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/debug/stats")
    async def debug_stats() -> JSONResponse:
        """A fresh engine-core snapshot (queues, KV blocks in use, counters)."""
        client = _require_ready(state)
        stats = await client.call("stats")
        return JSONResponse({**stats, "core_pid": client.info["pid"], "in_flight": state.in_flight})

    @app.post(contract.PATH_KV_TRANSFER_RELEASE)
    async def kv_transfer_release(request: Request) -> JSONResponse:
        """End the lease of signed params nobody will pull (their client went away). The
        signature proves the caller got the params from this deployment."""
        from baton_engine.contract import KVTransferParamsError
        from baton_engine.kv_transfer.params import load_key, verify_params

        body = decode_body(await _read_body(request, state.config.max_request_body_bytes))
        if state.config.kv_role not in ("producer", "both"):
            raise bad_request(
                f"kv_transfer_params: this engine's kv_role is {state.config.kv_role!r}, not producer",
                param="kv_transfer_params",
            )
        try:
            params = verify_params(body.get("kv_transfer_params"), load_key())
        except KVTransferParamsError as exc:
            raise bad_request(str(exc), param="kv_transfer_params") from exc
        client = _require_ready(state)
        released = await client.call("release_transfer", params.engine_id, params.transfer_id)
        log.info("kv transfer %s: release requested, released=%s", params.transfer_id, released)
        return JSONResponse({"transfer_id": params.transfer_id, "released": bool(released)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        request_id = _request_id(request, "cmpl")
        raw = await _read_body(request, state.config.max_request_body_bytes)

        def prepare() -> tuple[CompletionRequest, list[list[int]], RequestGrammar | None]:
            req: CompletionRequest = parse(CompletionRequest, decode_body(raw))
            _check_model(state, req.model)
            grammar = request_grammar(req)
            return req, _completion_prompts(state, req), grammar

        req, prompts, grammar = await _preprocess(state, len(raw), prepare)
        params = _sampling_params(state, req, prompts, req.max_tokens, req.logprobs, grammar)
        params, kv = _kv_transfer(state, req, prompts, params)
        gen = _start(state, request_id, prompts, params, req.timeout, kv, grammar)
        log.info(
            "request %s: completion, %d prompt(s), %d prompt tokens, stream=%s",
            request_id, len(prompts), sum(map(len, prompts)), req.stream,
        )  # fmt: skip
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _sse(state, gen, request_id, _completion_stream(state, gen, request_id, include_usage))
        return await _collect(state, request, gen, request_id, "text_completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        request_id = _request_id(request, "chatcmpl")
        raw = await _read_body(request, state.config.max_request_body_bytes)

        def prepare() -> tuple[
            ChatCompletionRequest, list[int], ToolCallFormat | None, RequestGrammar | None
        ]:
            req: ChatCompletionRequest = parse(ChatCompletionRequest, decode_body(raw))
            _check_model(state, req.model)
            tools = _tool_format(state, req)
            grammar = request_grammar(req, tools)
            return req, _chat_prompt(state, req), tools, grammar

        req, prompt, tool_format, grammar = await _preprocess(state, len(raw), prepare)
        tools = (
            None if tool_format is None else _ToolOutput(tool_format, req.parallel_tool_calls is not False)
        )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(state, req, [prompt], max_tokens, num_logprobs, grammar)
        params, kv = _kv_transfer(state, req, [prompt], params)
        gen = _start(state, request_id, [prompt], params, req.timeout, kv, grammar)
        log.info("request %s: chat, %d prompt tokens, stream=%s", request_id, len(prompt), req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _sse(state, gen, request_id, _chat_stream(state, gen, request_id, include_usage, tools))
        return await _collect(state, request, gen, request_id, "chat.completion", tools)

    return app


# ------------------------------------------------------------------------------ admission


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `limit` bytes (from its
    Content-Length before reading anything, else while reading a chunked body)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(declared: int | None, limit: int) -> APIError:
    """413; `declared` is the Content-Length, None for a body found too large while reading it."""
    size = f"{declared} bytes" if declared is not None else f"over {limit} bytes"
    return APIError(
        413,
        f"request body is {size}; this server accepts at most {limit} (--max-request-body-bytes)",
        code="request_too_large",
    )


async def _preprocess(state: ServerState, body_size: int, work: Callable[[], Any]) -> Any:
    """Run `work` (decode, validate, tokenize) inline for a small body, else in the
    preprocessing thread."""
    if body_size <= SMALL_BODY_BYTES:
        return work()
    return await asyncio.get_running_loop().run_in_executor(state.preprocessor, work)


def _check_text_fits(state: ServerState, num_chars: int, where: str, param: str) -> None:
    """Refuse, without tokenizing it, a text that cannot fit in max_model_len tokens whatever
    its tokenization (no token is longer than `ServerState.max_token_chars` characters)."""
    if state.max_token_chars and num_chars > state.max_model_len * state.max_token_chars:
        raise bad_request(
            f"{where}: {num_chars} characters cannot fit in max_model_len {state.max_model_len} tokens "
            f"(no token of this model is longer than {state.max_token_chars} characters)",
            param=param,
            code="context_length_exceeded",
        )


@dataclass(frozen=True)
class _ToolOutput:
    """How to read tool calls out of a chat answer."""

    format: ToolCallFormat
    parallel: bool
    """False (``parallel_tool_calls: false``): only the first call is returned."""


def _tool_format(state: ServerState, req: ChatCompletionRequest) -> ToolCallFormat | None:
    """The tool-call format to parse answers with; None when no tools may be called."""
    if not req.tools:
        return None
    fmt = tool_call_format(_tokenizer(state).chat_template)
    if fmt is None:
        raise bad_request(
            "tools: this model's chat template renders no tools (no tool-call format known for it)",
            param="tools",
        )
    return None if req.tool_choice == "none" else fmt


def _chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tokenizer = _tokenizer(state)
    messages = chat_messages(req)
    _check_text_fits(state, sum(len(m["content"]) for m in messages), "messages", "messages")
    extra: dict[str, Any] = {"tools": req.tools} if req.tools else {}
    try:
        return tokenizer.encode_chat(messages, **extra)  # type: ignore[no-any-return]
    except APIError:
        raise
    except Exception as exc:  # template errors (e.g. roles the template refuses)
        raise bad_request(f"messages: the chat template rejected them: {exc}", param="messages") from exc


def _request_id(request: Request, prefix: str) -> str:
    given = request.headers.get(REQUEST_ID_HEADER)
    request_id = (
        given if given and len(given) <= 256 and given.isprintable() else f"{prefix}-{uuid.uuid4().hex}"
    )
    request.state.request_id = request_id
    return request_id


def _require_ready(state: ServerState, *, allow_draining: bool = False) -> Any:
    if state.draining and not allow_draining:
        raise errors.draining()
    if not state.ready or state.client is None:
        raise APIError(503, "the model is still loading", type="service_unavailable", code="loading")
    dead = state.client.dead
    if dead:
        raise APIError(
            503, f"the engine is not running: {dead}", type="service_unavailable", code="engine_dead"
        )
    return state.client


def _tokenizer(state: ServerState) -> Any:
    _require_ready(state)
    if state.tokenizer is None:
        raise bad_request("this model has no tokenizer; send prompts as token id lists", param="prompt")
    return state.tokenizer


def _check_model(state: ServerState, model: str) -> None:
    _require_ready(state)
    if model != state.model_name:
        raise APIError(
            404,
            f"model: {shown(model)} does not exist; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    texts, prompts = prompt_parts(req.prompt)
    if texts:
        tokenizer = _tokenizer(state)
        for i, text in enumerate(texts):
            where = "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]"
            _check_text_fits(state, len(text), where, "prompt")
        prompts = [tokenizer.encode(t) for t in texts]
    for i, ids in enumerate(prompts):
        if not ids:
            raise bad_request(f"prompt[{i}]: must not be empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"prompt[{i}]: token id {bad} is out of range [0, {state.vocab_size})", param="prompt"
            )
    return prompts


def _sampling_params(
    state: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    max_tokens: int | None,
    num_logprobs: int | None,
    grammar: RequestGrammar | None = None,
) -> SamplingParams:
    longest = max(len(p) for p in prompts)
    if longest >= state.max_model_len:
        raise bad_request(
            f"prompt: {longest} tokens, but max_model_len is {state.max_model_len} (the prompt must leave "
            "room for at least one generated token)",
            param="prompt",
            code="context_length_exceeded",
        )
    room = state.max_model_len - longest
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"max_tokens: {max_tokens} plus the prompt's {longest} tokens exceeds max_model_len "
            f"{state.max_model_len}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        params = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=max_tokens,
            stop=tuple(stop_list(req)),
            ignore_eos=req.ignore_eos,
            seed=req.seed,
            logprobs=num_logprobs,
            n=req.n,
            grammar=None if grammar is None else grammar.grammar,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from exc
    extra = tuple(t for t in state.eos_token_ids[1:] if t not in params.stop_token_ids)
    if extra and not params.ignore_eos:
        import dataclasses

        params = dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)
    return params


def _kv_transfer(
    state: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[list[int]],
    params: SamplingParams,
) -> tuple[SamplingParams, dict[str, Any] | None]:
    """P/D legs: a producer leg runs with max_tokens=1; a consumer leg's params are verified
    here (signature first), so that bad ones are a 400 before any connection is made."""
    from baton_engine.contract import KVTransferParamsError
    from baton_engine.kv_transfer.request_params import check_request_params

    try:
        kv = check_request_params(req.kv_transfer_params, role=state.config.kv_role, prompts=prompts, n=req.n)
    except KVTransferParamsError as exc:
        raise bad_request(str(exc), param="kv_transfer_params") from exc
    if kv is not None and kv.get("do_remote_decode"):
        import dataclasses

        params = dataclasses.replace(params, max_tokens=1)
    return params, kv


def _start(
    state: ServerState,
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams,
    timeout: float | None,
    kv_transfer_params: dict[str, Any] | None = None,
    grammar: RequestGrammar | None = None,
) -> Generation:
    client = _require_ready(state)
    if client.num_not_started + len(prompts) * params.n > state.config.max_queued_requests:
        raise errors.server_overloaded(RETRY_AFTER_SECONDS)
    if state.tokenizer is None:
        raise APIError(
            400,
            "this model has no tokenizer files, so the server cannot produce text for it",
            param="model",
            code="no_tokenizer",
        )
    return Generation(
        client,
        state.tokenizer,
        state.metrics,
        request_id,
        prompts,
        params,
        timeout=timeout,
        kv_transfer_params=kv_transfer_params,
        grammar_param=None if grammar is None else grammar.param,
    )


# ------------------------------------------------------------------------------ responses


def _error_event(exc: APIError) -> str:
    return f"data: {json.dumps(exc.body())}\n\n"


def _sse(
    state: ServerState, gen: Generation, request_id: str, events: AsyncGenerator[str, None]
) -> StreamingResponse:
    state.in_flight += 1

    async def body() -> AsyncIterator[str]:
        delivered = False
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
            delivered = True  # the last event was sent: the response asked for the next one
        finally:
            state.in_flight -= 1
            if not delivered:
                gen.release_transfer()  # a P/D producer leg whose params never got out
            log.info("request %s: stream closed", request_id)

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={REQUEST_ID_HEADER: request_id, "Cache-Control": "no-cache"},
    )


async def _guarded(gen: Generation) -> AsyncIterator[list[ChoiceDelta]]:
    """Deltas with engine failures turned into API errors (the caller decides how to send them)."""
    async with contextlib.aclosing(gen.deltas()) as deltas:
        try:
            async for batch in deltas:
                for delta in batch:
                    if delta.finish_reason == "rejected":
                        raise _rejected(gen, delta.message or "rejected by the engine")
                yield batch
        except DeadlineExceeded as exc:
            raise errors.deadline_exceeded(gen.timeout or 0.0) from exc
        except EngineDeadError as exc:
            raise APIError(500, str(exc), type="internal_error", code="engine_dead") from exc


def _rejected(gen: Generation, message: str) -> APIError:
    """The 400 of a request the engine core refused, naming the field its reason is about."""
    if message.startswith("kv_transfer_params:"):
        return bad_request(message, param="kv_transfer_params")
    if message.startswith("grammar:") and gen.grammar_param is not None:
        reason = message.removeprefix("grammar:").lstrip()
        return bad_request(f"{gen.grammar_param}: {reason}", param=gen.grammar_param)
    return bad_request(f"prompt: {message}", param="prompt")


def _chunk_writer(
    state: ServerState, request_id: str, kind: str, include_usage: bool
) -> Callable[[list[dict[str, Any]], dict[str, Any] | None], str]:
    """Formats one SSE chunk of OpenAI's streaming shape (`kind` is its ``object`` field)."""
    created = now()

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": state.model_name,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    return chunk


async def _finish_stream(
    gen: Generation,
    request_id: str,
    include_usage: bool,
    chunk: Callable[[list[dict[str, Any]], dict[str, Any] | None], str],
    events: AsyncGenerator[str, None],
) -> AsyncGenerator[str, None]:
    """`events`, then the usage chunk and the KV-transfer chunk, or the error event if the
    generation failed; always ends with ``[DONE]``."""
    try:
        async with contextlib.aclosing(events) as body:
            async for event in body:
                yield event
    except APIError as exc:
        yield _error_event(exc)
    else:
        if include_usage:
            yield chunk([], gen.usage.to_dict())
        if gen.kv_transfer_params_out is not None:
            kv_chunk = {"id": request_id, "kv_transfer_params": gen.kv_transfer_params_out}
            yield f"data: {json.dumps(kv_chunk)}\n\n"
    yield "data: [DONE]\n\n"


def _completion_stream(
    state: ServerState, gen: Generation, request_id: str, include_usage: bool
) -> AsyncGenerator[str, None]:
    chunk = _chunk_writer(state, request_id, "text_completion", include_usage)
    token_text = state.token_text
    offsets: dict[int, int] = {}

    async def events() -> AsyncGenerator[str, None]:
        async for batch in _guarded(gen):
            choices = []
            for d in batch:
                logprobs = None
                if d.logprobs is not None and token_text is not None:
                    logprobs = completion_logprobs(d.logprobs, token_text, offsets.get(d.index, 0))
                offsets[d.index] = offsets.get(d.index, 0) + len(d.text)
                choices.append(
                    {"index": d.index, "text": d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
                )
            yield chunk(choices, None)

    return _finish_stream(gen, request_id, include_usage, chunk, events())


def _chat_stream(
    state: ServerState, gen: Generation, request_id: str, include_usage: bool, tools: _ToolOutput | None
) -> AsyncGenerator[str, None]:
    chunk = _chunk_writer(state, request_id, "chat.completion.chunk", include_usage)
    token_text = state.token_text
    n = len(gen.prompts) * gen.params.n
    parsers = [StreamingToolParser(tools.format) for _ in range(n)] if tools is not None else None

    def tool_deltas(index: int, text: str, finished: bool) -> list[dict[str, Any]]:
        """The text as deltas: content, and calls (each in one delta) once complete."""
        if parsers is None or tools is None:
            return [{"content": text}] if text else []
        parser = parsers[index]
        events = parser.feed(text) + (parser.finish() if finished else [])
        out: list[dict[str, Any]] = []
        for event in events:
            if event.tool_call is not None:
                if tools.parallel or event.index == 0:
                    out.append({"tool_calls": [event.tool_call.to_dict(event.index)]})
            elif event.content:
                out.append({"content": event.content})
        return out

    async def events() -> AsyncGenerator[str, None]:
        first = {"role": "assistant", "content": ""}
        yield chunk(
            [{"index": i, "delta": first, "logprobs": None, "finish_reason": None} for i in range(n)], None
        )
        async for batch in _guarded(gen):
            # Chunk k carries each choice's k-th delta (content, then a call): a chunk names a
            # choice once.
            rounds: list[list[dict[str, Any]]] = []
            for d in batch:
                if not d.text and d.finish_reason is None and not d.logprobs:
                    continue  # tokens that do not yet form text (a partial UTF-8 character)
                logprobs = None
                if d.logprobs is not None and token_text is not None:
                    logprobs = chat_logprobs(d.logprobs, token_text)
                deltas = tool_deltas(d.index, d.text, d.finish_reason is not None)
                finish = d.finish_reason
                if finish == "stop" and parsers is not None and parsers[d.index].num_calls:
                    finish = "tool_calls"
                if not deltas:
                    if finish is None and logprobs is None:
                        continue  # text the tool-call parser holds until it knows if it is a call
                    deltas = [{"content": ""}] if finish is None else [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    if k == len(rounds):
                        rounds.append([])
                    rounds[k].append(
                        {
                            "index": d.index,
                            "delta": delta,
                            "logprobs": logprobs if k == 0 else None,
                            "finish_reason": finish if last else None,
                        }
                    )
            for choices in rounds:
                yield chunk(choices, None)

    return _finish_stream(gen, request_id, include_usage, chunk, events())


async def _client_disconnect(request: Request) -> None:
    """Return once the client has closed its connection (the request body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(
    state: ServerState,
    request: Request,
    gen: Generation,
    request_id: str,
    kind: str,
    tools: _ToolOutput | None = None,
) -> Response:
    """A non-streaming answer; a client that goes away meanwhile aborts the request."""
    n = len(gen.prompts) * gen.params.n
    texts = [""] * n
    finish: list[str | None] = [None] * n
    logprobs: list[list[Any]] = [[] for _ in range(n)]

    async def run() -> None:
        async for batch in _guarded(gen):
            for d in batch:
                texts[d.index] += d.text
                if d.finish_reason is not None:
                    finish[d.index] = d.finish_reason
                if d.logprobs is not None:
                    logprobs[d.index].extend(d.logprobs)

    state.in_flight += 1
    task = asyncio.create_task(run())
    # Waiting on the ASGI receive channel sees the disconnect the moment the socket closes; polling
    # is_disconnected() on a timer let a fast model finish the whole request first.
    gone = asyncio.create_task(_client_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            log.info("request %s: client disconnected; aborting", request_id)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            gen.release_transfer()  # the prefill may have finished meanwhile (lease held)
            return Response(status_code=499)
        task.result()
        if gen.kv_transfer_params_out is not None and (gone.done() or await request.is_disconnected()):
            # nobody will pass these params on to a consumer: free the lease now
            log.info("request %s: client gone before its kv_transfer_params; releasing", request_id)
            gen.release_transfer()
            return Response(status_code=499)
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
        state.in_flight -= 1

    token_text = state.token_text
    want_logprobs = gen.params.logprobs is not None and token_text is not None
    choices: list[dict[str, Any]] = []
    for i in range(n):
        if kind == "text_completion":
            lp = completion_logprobs(logprobs[i], token_text, 0) if want_logprobs else None  # type: ignore[arg-type]
            choices.append({"index": i, "text": texts[i], "logprobs": lp, "finish_reason": finish[i]})
        else:
            lp = chat_logprobs(logprobs[i], token_text) if want_logprobs else None  # type: ignore[arg-type]
            message: dict[str, Any] = {"role": "assistant", "content": texts[i]}
            reason = finish[i]
            if tools is not None:
                parsed = parse_tool_calls(texts[i], tools.format)
                calls: list[ToolCall] = parsed.tool_calls if tools.parallel else parsed.tool_calls[:1]
                if calls:
                    message = {
                        "role": "assistant",
                        "content": parsed.content,
                        "tool_calls": [c.to_dict() for c in calls],
                    }
                    reason = "tool_calls" if reason == "stop" else reason
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason})
    body = {
        "id": request_id,
        "object": kind,
        "created": now(),
        "model": state.model_name,
        "choices": choices,
        "usage": gen.usage.to_dict(),
    }
    if gen.kv_transfer_params_out is not None:
        body["kv_transfer_params"] = gen.kv_transfer_params_out
    log.info("request %s: done, %d completion tokens", request_id, gen.usage.completion_tokens)
    return JSONResponse(body, headers={REQUEST_ID_HEADER: request_id})
