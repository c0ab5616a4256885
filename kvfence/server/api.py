"""The OpenAI-compatible HTTP front of one engine node: routes, request -> engine, SSE, serve()."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults
from kvfence.role import RoleService, TokenizerLike
from kvfence.server.app_state import AppState, Event, Generation
from kvfence.server.auth import Authenticator, load_api_keys, single_authorization
from kvfence.server.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    APIError,
    bad_request,
    error_body,
    from_validation_error,
    install_handlers,
)
from kvfence.server.metrics import RequestRecord, RequestRecorder, ServerMetrics
from kvfence.server.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    ChatCompletionRequest,
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    CompletionRequest,
    usage,
)

logger = logging.getLogger("kvfence.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_FAILED = (FinishReason.ERROR, FinishReason.ABORT)
_M = TypeVar("_M", bound=BaseModel)


def build_app(
    engine: RoleService,
    *,
    api_keys: dict[str, str] | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    faults: Faults | None = None,
) -> FastAPI:
    """The app for one role. It neither starts nor stops the role (serve() does). faults: the
    process's fault points (the I6 twin's); no request can arm one."""
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    metrics = ServerMetrics(engine)
    faults = faults if faults is not None else Faults()
    state = AppState(engine, Authenticator(api_keys), metrics, max_body_bytes, faults)
    app = FastAPI(title="kvfence", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvfence = state
    install_handlers(app)
    app.add_middleware(RequestRecorder, metrics=metrics)

    @app.get("/health")
    async def health() -> JSONResponse:
        if _engine_alive(engine):
            return JSONResponse({"status": "ok"})
        body = error_body(
            "The engine loop is not running.", type=SERVER_ERROR, param=None, code="engine_dead"
        )
        return JSONResponse(body, status_code=503)

    @app.get("/pd/info")
    async def pd_info() -> JSONResponse:
        # The router learns each worker's role and bootstrap address here.
        return JSONResponse(engine.info())

    @app.get("/metrics")
    async def metrics_route() -> Response:
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        _authenticate(state, request)
        return JSONResponse({"object": "list", "data": [_model_card(engine)]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> JSONResponse:
        _authenticate(state, request)
        _check_model(engine, model_id)
        return JSONResponse(_model_card(engine))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = _authenticate(state, request)
        req = _parse(CompletionRequest, await _read_body(request, state.max_body_bytes))
        req.check_supported()
        _check_model(engine, req.model)
        _check_choices(len(req.prompts), req.choices_per_prompt)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        sampling = req.sampling_params(max_tokens, req.logprobs)
        prompts = await asyncio.to_thread(_encode_prompts, engine.tokenizer, req.prompts)
        ids = _request_ids(len(prompts) * req.choices_per_prompt)
        fmt = CompletionFormat(
            f"cmpl-{ids[0]}",
            engine.model_name,
            req.logprobs is not None,
            _token_text(engine, req.return_tokens_as_token_ids),
        )
        return await _generate(
            state,
            request,
            tenant,
            fmt,
            ids,
            prompts,
            sampling,
            req.choices_per_prompt,
            bool(req.stream),
            req.include_usage,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = _authenticate(state, request)
        req = _parse(ChatCompletionRequest, await _read_body(request, state.max_body_bytes))
        req.check_supported()
        _check_model(engine, req.model)
        sampling = req.sampling_params(req.effective_max_tokens, req.engine_logprobs)
        messages = [m.template_dict() for m in req.messages]
        prompt = await asyncio.to_thread(_render_chat, engine.tokenizer, messages)
        ids = _request_ids(req.choices_per_prompt)
        fmt = ChatFormat(
            f"chatcmpl-{ids[0]}",
            engine.model_name,
            bool(req.logprobs),
            _token_text(engine, req.return_tokens_as_token_ids),
        )
        return await _generate(
            state,
            request,
            tenant,
            fmt,
            ids,
            [prompt],
            sampling,
            req.choices_per_prompt,
            bool(req.stream),
            req.include_usage,
        )

    return app


class _ReadyServer(uvicorn.Server):
    """Prints one ready line once the socket listens, so scripts and people know when to send."""

    def __init__(self, config: uvicorn.Config, ready: str) -> None:
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self._ready, flush=True)


def _ready_line(engine: RoleService, host: str, port: int) -> str:
    url = f"http://{host}:{port}"
    role = engine.info()["role"]
    if role != "unified":
        # A PD worker takes no client requests: point at the router, not at a sample curl.
        return f"kvfence {role} worker ready: {url} (clients go through `kvfence router`)"
    body = json.dumps(
        {
            "model": engine.model_name,
            "prompt": "name: Ada\ncode: X7qPz91LmWk2\ncity: Paris\ncode:",
            "max_tokens": 12,
            "temperature": 0,
            "stop": "\n",
        }
    )
    return (
        f"kvfence ready: {url} (model {engine.model_name}, context {engine.context_length})\n"
        f"  try: curl -s {url}/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    )


def serve(
    engine: RoleService,
    host: str,
    port: int,
    api_key_file: str | None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
    faults: Faults | None = None,
) -> None:
    """Run the HTTP server until interrupted. Owns the engine's lifetime: start() before the
    socket opens, shutdown() after the last connection closes."""
    # A bad key file must stop us before anything listens or allocates.
    api_keys = load_api_keys(api_key_file) if api_key_file else None
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    app = build_app(engine, api_keys=api_keys, max_body_bytes=max_body_bytes, faults=faults)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    # uvicorn drains connections on SIGINT/SIGTERM, then re-raises the signal; SIGTERM's default
    # action would kill us before the engine shuts down, so both arrive as KeyboardInterrupt.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    engine.start()
    try:
        _ReadyServer(config, _ready_line(engine, host, port)).run()
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        engine.shutdown()
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


# ---- request handling ------------------------------------------------------------------------


def _engine_alive(engine: RoleService) -> bool:
    try:
        return bool(engine.alive)
    except Exception:
        logger.exception("engine.alive failed")
        return False


def _model_card(engine: RoleService) -> dict[str, Any]:
    return {
        "id": engine.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kvfence",
        "max_model_len": engine.context_length,  # vLLM's name; clients read context length here
    }


def _record(request: Request) -> RequestRecord:
    rec = request.scope.get("kvfence.record")
    return rec if rec is not None else RequestRecord()


def _authenticate(state: AppState, request: Request) -> str:
    # I6: the tenant comes from the credential only; body fields and headers never name it.
    tenant = state.auth.tenant_for(single_authorization(request.headers.getlist("authorization")))
    if not state.faults.guards().on("credential_tenant") and request.headers.get("x-tenant"):
        tenant = request.headers["x-tenant"]  # the bug I6 forbids, for its twin test only
    _record(request).tenant = tenant
    return tenant


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"Request body is larger than the {limit}-byte limit (at least {size} bytes).",
        code="request_too_large",
    )


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise bad_request("Invalid Content-Length header.", code="invalid_header") from None
        if size > limit:
            raise _too_large(size, limit)
    # The header can be absent (chunked) or wrong: count what actually arrives.
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(received, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(model: type[_M], body: bytes) -> _M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_model(engine: RoleService, name: str) -> None:
    if name != engine.model_name:
        raise APIError(
            404,
            f"The model `{name}` does not exist. This server serves `{engine.model_name}`.",
            code="model_not_found",
            param="model",
        )


def _check_choices(n_prompts: int, n: int) -> None:
    if n_prompts * n > MAX_CHOICES:
        raise bad_request(
            f"{n_prompts} prompts x n={n} is {n_prompts * n} generations; "
            f"at most {MAX_CHOICES} are allowed per request.",
            param="n",
        )


def _request_ids(count: int) -> list[str]:
    # 128-bit random: request ids become room ids in PD mode and must be unguessable (I8).
    return [secrets.token_hex(16) for _ in range(count)]


def _encode_prompts(tokenizer: TokenizerLike, prompts: list[str | list[int]]) -> list[list[int]]:
    # An empty string is an empty prompt (admission's 400), not a lone BOS to continue from.
    return [(tokenizer.encode(p) if p else []) if isinstance(p, str) else p for p in prompts]


def _render_chat(tokenizer: TokenizerLike, messages: list[dict[str, Any]]) -> list[int]:
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError as e:  # ChatTemplateError: templates refuse some message orders
        raise bad_request(
            f"The chat template rejected these messages: {e}",
            code="invalid_messages",
            param="messages",
        ) from e


def _token_text(engine: RoleService, as_ids: bool | None = False) -> Any:
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    tok = engine.tokenizer
    return lambda token_id: tok.decode([token_id])


class _Progress:
    """Accumulates outputs per choice and feeds the latency/finish metrics as they arrive."""

    def __init__(self, state: AppState, rec: RequestRecord, n_choices: int, prompt_tokens: int):
        self.metrics = state.metrics
        self.rec = rec
        self.choices = [ChoiceState(i) for i in range(n_choices)]
        self.prompt_tokens = prompt_tokens
        self._first_token_at: float | None = None
        self._last_at: list[float | None] = [None] * n_choices

    def apply(self, index: int, out: RequestOutput) -> ChoiceState:
        now = time.monotonic()
        c = self.choices[index]
        if out.new_token_ids:
            if self._first_token_at is None:
                self._first_token_at = now
                self.metrics.ttft.observe(now - self.rec.start)
            last = self._last_at[index]
            if last is not None:
                self.metrics.itl.observe(now - last)
            self._last_at[index] = now
        c.text.append(out.new_text)
        c.logprobs.extend(out.logprobs)
        c.text_offset += len(out.new_text)
        c.completion_tokens = out.completion_tokens  # cumulative per the engine contract
        self.rec.completion_tokens = sum(x.completion_tokens for x in self.choices)
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason.value
            self.rec.finish = out.finish_reason.value
            self.metrics.finishes.labels(reason=out.finish_reason.value).inc()
            if all(x.finish_reason is not None for x in self.choices):
                self.metrics.e2e.observe(now - self.rec.start)
        return c

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.rec.completion_tokens)


def _engine_failure(out: RequestOutput) -> APIError:
    # I5: the client sees the engine's reason, never a 200 with what was produced so far.
    if out.finish_reason is FinishReason.ERROR:
        status = out.error_status or 500
        return APIError(
            status,
            out.error or "The engine failed this request.",
            code=out.error_code or "internal_error",
            # A 4xx from another door (e.g. prefill's admission in PD mode) keeps its type.
            type=INVALID_REQUEST if 400 <= status < 500 else SERVER_ERROR,
        )
    return APIError(
        503,
        "The request was aborted by the server before it finished.",
        code="request_aborted",
        type=SERVER_ERROR,
    )


async def _generate(
    state: AppState,
    request: Request,
    tenant: str,
    fmt: CompletionFormat,
    ids: list[str],
    prompts: list[list[int]],
    sampling: SamplingParams,
    n: int,
    stream: bool,
    include_usage: bool,
) -> Response:
    rec = _record(request)
    rec.request_id = ids[0]
    rec.n_generations = len(ids)
    # Choice index = prompt index * n + j, as OpenAI numbers them.
    reqs = [
        GenerateRequest(
            request_id=ids[p * n + j],
            tenant=tenant,
            prompt_token_ids=tuple(prompt),
            sampling=sampling,
            # Set by the router in PD mode; only a decode worker reads it.
            peer=request.headers.get("x-kvfence-prefill"),
        )
        for p, prompt in enumerate(prompts)
        for j in range(n)
    ]
    gen = Generation(state.engine, reqs)
    handed_off = False
    try:
        rejected = await gen.submit()
        if rejected is not None:
            raise APIError(400, rejected.message, code=rejected.code, param=rejected.param)
        progress = _Progress(state, rec, len(reqs), sum(len(p) for p in prompts))
        rec.prompt_tokens = progress.prompt_tokens
        gen.watch_disconnect(request.receive)
        if not stream:
            return await _collect(gen, fmt, progress)
        first = await _until_first_token(gen, progress)
        if first is None:
            return _client_gone(rec)
        handed_off = True
        return _SSEResponse(gen, _sse_chunks(gen, fmt, progress, first, include_usage))
    finally:
        if not handed_off:
            gen.close()


def _client_gone(rec: RequestRecord) -> Response:
    rec.finish = "client_gone"
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _collect(gen: Generation, fmt: CompletionFormat, progress: _Progress) -> Response:
    while not gen.all_finished:
        event = await gen.next_event()
        if event is None:
            return _client_gone(progress.rec)
        index, out = event
        progress.apply(index, out)
        if out.finish_reason in _FAILED:
            raise _engine_failure(out)
    return JSONResponse(fmt.body(progress.choices, progress.usage()))


async def _until_first_token(gen: Generation, progress: _Progress) -> list[Event] | None:
    """Hold the status line until something real arrives, so a failure before the first token is
    still an HTTP error status rather than an error buried in a 200 stream."""
    events: list[Event] = []
    while True:
        event = await gen.next_event()
        if event is None:
            return None
        events.append(event)
        _, out = event
        if out.finish_reason in _FAILED:
            progress.apply(*event)
            raise _engine_failure(out)
        if out.new_token_ids or out.new_text or out.finished:
            return events


def _sse(obj: dict[str, Any], include_usage: bool) -> bytes:
    if include_usage and "usage" not in obj:
        obj["usage"] = None
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode("utf-8") + b"\n\n"


async def _sse_chunks(
    gen: Generation,
    fmt: CompletionFormat,
    progress: _Progress,
    first: list[Event],
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    for chunk in fmt.start_chunks(len(gen.requests)):
        yield _sse(chunk, include_usage)
    pending = deque(first)
    while pending or not gen.all_finished:
        event = pending.popleft() if pending else await gen.next_event()
        if event is None:
            progress.rec.finish = "client_gone"
            return
        index, out = event
        offset = progress.choices[index].text_offset
        choice = progress.apply(index, out)
        if out.finish_reason in _FAILED:
            # Headers are gone: an error event, then silence. Never [DONE] after partial text.
            err = _engine_failure(out)
            progress.rec.error_code = err.code
            yield _sse(err.body(), include_usage=False)
            return
        finish = out.finish_reason.value if out.finish_reason is not None else None
        for chunk in fmt.delta_chunks(choice, out.new_text, out.logprobs, offset, finish):
            yield _sse(chunk, include_usage)
    if include_usage:
        yield _sse(fmt.usage_chunk(progress.usage()), include_usage)
    yield b"data: [DONE]\n\n"


class _SSEResponse(StreamingResponse):
    """Streams a Generation. Whatever ends the stream (done, error, hang-up, server shutdown),
    the finally aborts what is unfinished: this response owns the Generation once returned."""

    def __init__(self, gen: Generation, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(
            chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._gen = gen
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # ASGI 2.4 servers raise on send to a closed connection
            pass
        finally:
            self._gen.close()
            await self._chunks.aclose()


__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app", "serve"]
