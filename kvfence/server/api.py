"""The OpenAI-compatible HTTP front of one engine node: routes, request parsing and checks, and
serve(). Running a parsed request through the engine to its answer is server/generate.py."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from kvfence.faults import Faults

if TYPE_CHECKING:
    from kvfence.lora.checkpoint import LoraAdapter
from kvfence.config import DEFAULT_MAX_TOOL_CALLS
from kvfence.role import RoleService, TokenizerLike
from kvfence.server import openapi
from kvfence.server.app_state import AppState, step_outbox
from kvfence.server.auth import Authenticator, load_api_keys, single_authorization
from kvfence.server.drain import DEFAULT_DRAIN_TIMEOUT_S, Drain, DrainingServer
from kvfence.server.errors import (
    SERVER_ERROR,
    APIError,
    bad_request,
    error_body,
    from_validation_error,
    install_handlers,
)
from kvfence.server.generate import generate, record
from kvfence.server.hop import HopVerifier
from kvfence.server.httpio import read_body, server_config
from kvfence.server.lora_routes import add_lora_routes, lora_names, resolve_lora
from kvfence.server.metrics import RequestRecorder, ServerMetrics
from kvfence.server.operator import OperatorGate, load_operator_key
from kvfence.server.prompt_echo import PromptAsk, completion_ask, engine_k
from kvfence.server.request_id import RequestIdMiddleware
from kvfence.server.responses import ResponsesFormat
from kvfence.server.responses_schema import ResponsesRequest
from kvfence.server.schemas import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHOICES,
    AnswerFormat,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
)
from kvfence.server.tokenize import add_tokenize_routes
from kvfence.server.tools import ToolChatFormat, plan_tools

logger = logging.getLogger("kvfence.server")

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_M = TypeVar("_M", bound=BaseModel)


def build_app(
    engine: RoleService,
    *,
    api_keys: dict[str, str] | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    faults: Faults | None = None,
    drain: Drain | None = None,
    tool_call_parser: str | None = None,
    operator_key: str | None = None,
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
) -> FastAPI:
    """The app for one role. It neither starts nor stops the role (serve() does). faults: the
    process's fault points (the I6 twin's); no request can arm one. drain: the node's graceful
    drain (serve() begins it on SIGTERM). tool_call_parser: how chat answers with tool_choice
    "auto" are read for calls (server/tool_parsers.py; None: refused); max_tool_calls: the
    most calls one answer may make (server/tools.py). operator_key: the one
    credential that reads /metrics and /pd/info (server/operator.py) and checks the router's
    signed prefill address (server/hop.py)."""
    if max_body_bytes < 1:
        raise ValueError("max_body_bytes must be >= 1")
    faults = faults if faults is not None else Faults()
    metrics = ServerMetrics(engine, faults)
    drain = drain if drain is not None else Drain(engine)
    state = AppState(
        engine,
        Authenticator(api_keys),
        metrics,
        max_body_bytes,
        faults,
        drain,
        OperatorGate(operator_key, api_keys is not None, faults),
        HopVerifier(operator_key, faults, dials=_role(engine) == "decode"),
        step_outbox(engine),
    )
    # This worker process's id in /pd/info: a restarted worker reports another one, which is how
    # the router knows its prefix cache started empty (the router then forgets its predictions).
    instance = secrets.token_hex(8)
    app = FastAPI(title="kvfence", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvfence = state
    install_handlers(app)
    app.add_middleware(RequestRecorder, metrics=metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost: the recorder logs the checked id

    @app.get("/health")
    async def health() -> JSONResponse:
        # Readiness (the router's poll, Kubernetes' readinessProbe): 503 from the moment a drain
        # begins, so nothing new is sent here while what was admitted finishes.
        if not _engine_alive(engine):
            return _engine_dead()
        if drain.draining:
            body = error_body(
                "This worker is draining (shutting down); it admits no new requests.",
                type=SERVER_ERROR,
                param=None,
                code="draining",
            )
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/live")
    async def live() -> JSONResponse:
        # Liveness: the engine loop runs, draining or not (a drain must not look like a hang).
        return JSONResponse({"status": "ok"}) if _engine_alive(engine) else _engine_dead()

    # Anonymous /health says up or down, nothing else; what follows names rooms, tenants and
    # their counts, so only the operator reads it.
    @app.get("/pd/info")
    async def pd_info(request: Request) -> JSONResponse:
        # The router learns each worker's role and bootstrap address here.
        state.operator.require(request.headers)
        return JSONResponse({**engine.info(), "instance": instance})

    @app.get("/metrics")
    async def metrics_route(request: Request) -> Response:
        state.operator.require(request.headers)
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        tenant = _authenticate(state, request)
        cards = [_model_card(engine)] + [
            _model_card(engine, name) for name in lora_names(engine, tenant)
        ]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> JSONResponse:
        tenant = _authenticate(state, request)
        lora = _check_model(engine, model_id, tenant)
        return JSONResponse(_model_card(engine, None if lora is None else model_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        tenant = _authenticate(state, request)
        req = _parse(CompletionRequest, await read_body(request, state.max_body_bytes))
        req.check_supported()
        lora = _check_model(engine, req.model, tenant)
        _check_choices(len(req.prompts), req.choices_per_prompt)
        if any(isinstance(p, str) for p in req.prompts):
            _require_text(engine, "prompt")
        if req.stop_list:
            _require_text(engine, "stop")
        if req.echo:
            _require_text(engine, "echo")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        sampling = req.sampling_params(
            # max_tokens 0 (echo): the prefill still samples one token, which is never shown
            max(max_tokens, 1),
            req.logprobs,
            req.constraint(),
            engine_k(bool(req.echo), req.logprobs, req.prompt_logprobs),
        )
        prompts = await asyncio.to_thread(_encode_prompts, engine.tokenizer, req.prompts)
        ids = _request_ids(len(prompts) * req.choices_per_prompt)
        fmt = CompletionFormat(
            f"cmpl-{ids[0]}",
            req.model,  # the base model's name or the adapter's, as the client asked
            req.logprobs is not None,
            _token_text(engine, req.return_tokens_as_token_ids),
        )
        fmt.ask = await asyncio.to_thread(
            completion_ask,
            req.prompts,
            prompts,
            req.choices_per_prompt,
            bool(req.echo),
            req.logprobs,
            req.prompt_logprobs,
            max_tokens,
            engine.tokenizer.decode,
        )
        return await generate(
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
            req.cache_salt,
            lora,
        )

    async def run_chat(
        request: Request,
        tenant: str,
        req: ChatCompletionRequest,
        responses: ResponsesRequest | None = None,
    ) -> Response:
        """A chat request through the engine; `responses`: the /v1/responses request it was
        read from, whose answer is then shaped as a `response`."""
        req.check_supported()
        lora = _check_model(engine, req.model, tenant)
        _require_text(engine, "messages" if responses is None else "input")
        plan = plan_tools(
            req.tools, req.tool_choice, req.parallel_tool_calls, tool_call_parser, max_tool_calls
        )
        constraint = req.constraint()
        if plan is not None and plan.constraint is not None:
            if constraint is not None:
                raise bad_request(
                    "tool_choice required/named and a response format both constrain the "
                    "answer: send one",
                    param="tool_choice",
                )
            constraint = plan.constraint
        sampling = req.sampling_params(
            req.effective_max_tokens, req.engine_logprobs, constraint, req.prompt_logprobs
        )
        messages = [m.template_dict() for m in req.messages]
        prompt = await asyncio.to_thread(_render_chat, engine.tokenizer, messages, req.tools)
        ids = _request_ids(req.choices_per_prompt)
        token_text = _token_text(engine, req.return_tokens_as_token_ids)
        chat = (
            ChatFormat(f"chatcmpl-{ids[0]}", req.model, bool(req.logprobs), token_text)
            if plan is None
            else ToolChatFormat(
                f"chatcmpl-{ids[0]}", req.model, bool(req.logprobs), token_text, plan
            )
        )
        if req.prompt_logprobs is not None:
            chat.ask = PromptAsk([prompt], req.choices_per_prompt, field_k=req.prompt_logprobs)
        fmt: AnswerFormat = chat
        if responses is not None:
            fmt = ResponsesFormat(chat, responses, f"resp_{ids[0]}")
        return await generate(
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
            req.cache_salt,
            lora,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        tenant = _authenticate(state, request)
        req = await _read_json(state, request, ChatCompletionRequest)
        return await run_chat(request, tenant, req)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        tenant = _authenticate(state, request)
        req = await _read_json(state, request, ResponsesRequest)
        req.check_supported()
        chat = req.chat_request()  # run_chat resolves the model (an adapter) for the tenant
        chat.stream = req.stream
        return await run_chat(request, tenant, chat, req)

    add_lora_routes(app, engine, state.operator)
    add_tokenize_routes(
        app,
        engine,
        authenticate=lambda request: _authenticate(state, request),
        read_json=lambda request, model: _read_json(state, request, model),
        check_model=lambda name, tenant: _check_model(engine, name, tenant),
        require_text=lambda param: _require_text(engine, param),
    )
    openapi.install(app)
    return app


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
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    tool_call_parser: str | None = None,
    admin_api_key_file: str | None = None,
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
) -> None:
    """Run the HTTP server until interrupted. Owns the engine's lifetime: start() before the
    socket opens, shutdown() after the last connection closes. SIGTERM drains first
    (kvfence/server/drain.py); SIGINT or a second SIGTERM stops at once."""
    # A bad key file must stop us before anything listens or allocates.
    api_keys = load_api_keys(api_key_file) if api_key_file else None
    operator_key = load_operator_key(admin_api_key_file)
    if operator_key is None and engine.info()["role"] == "decode":
        raise ValueError(
            "a decode worker dials only the prefill its router signed for: give it the "
            "router's operator key (--admin-api-key-file or KVFENCE_ADMIN_API_KEY; "
            "`kvfence up` makes one)"
        )
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    drain = Drain(engine, drain_timeout)
    app = build_app(
        engine,
        api_keys=api_keys,
        max_body_bytes=max_body_bytes,
        faults=faults,
        drain=drain,
        tool_call_parser=tool_call_parser,
        operator_key=operator_key,
        max_tool_calls=max_tool_calls,
    )
    # After a drain the connections are idle; the bound is for a second SIGTERM or SIGINT.
    config = server_config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
    )
    # uvicorn drains connections on SIGINT/SIGTERM, then re-raises the signal; SIGTERM's default
    # action would kill us before the engine shuts down, so both arrive as KeyboardInterrupt.
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main else None
    engine.start()
    try:
        DrainingServer(config, lambda bound: _ready_line(engine, host, bound), drain).run()
    except KeyboardInterrupt:
        logger.info("shutting down")
    finally:
        engine.shutdown()
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


# ---- request handling ------------------------------------------------------------------------


def _role(engine: RoleService) -> str:
    try:
        return str(engine.info().get("role"))
    except Exception:  # a test double without info(): not a decode
        return "unknown"


def _engine_alive(engine: RoleService) -> bool:
    try:
        return bool(engine.alive)
    except Exception:
        logger.exception("engine.alive failed")
        return False


def _engine_dead() -> JSONResponse:
    body = error_body(
        "The engine loop is not running.", type=SERVER_ERROR, param=None, code="engine_dead"
    )
    return JSONResponse(body, status_code=503)


def _model_card(engine: RoleService, adapter: str | None = None) -> dict[str, Any]:
    card = {
        "id": adapter or engine.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "kvfence",
        "max_model_len": engine.context_length,  # vLLM's name; clients read context length here
    }
    if adapter is not None:  # vLLM's field; never the adapter's path on this host
        card["parent"] = engine.model_name
    return card


def _authenticate(state: AppState, request: Request) -> str:
    # I6: the tenant comes from the credential only; body fields and headers never name it.
    tenant = state.auth.tenant_for(single_authorization(request.headers.getlist("authorization")))
    if not state.faults.guards().on("credential_tenant") and request.headers.get("x-tenant"):
        tenant = request.headers["x-tenant"]  # the bug I6 forbids, for its twin test only
    record(request).tenant = tenant
    return tenant


async def _read_json(state: AppState, request: Request, model: type[_M]) -> _M:
    return _parse(model, await read_body(request, state.max_body_bytes))


def _parse(model: type[_M], body: bytes) -> _M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _check_model(engine: RoleService, name: str, tenant: str) -> LoraAdapter | None:
    """None for the base model, the adapter for an adapter `tenant` may use; anything else,
    an adapter it may not use included, is the one 404 (existence is not leaked)."""
    if name == engine.model_name:
        return None
    lora = resolve_lora(engine, name, tenant)
    if lora is None:
        raise APIError(
            404,
            f"The model `{name}` does not exist. This server serves `{engine.model_name}`.",
            code="model_not_found",
            param="model",
        )
    return lora


def _has_text(engine: RoleService) -> bool:
    return bool(getattr(engine.tokenizer, "has_text", True))  # False: --skip-tokenizer-init


def _require_text(engine: RoleService, param: str) -> None:
    if not _has_text(engine):
        raise bad_request(
            "This server runs with --skip-tokenizer-init: send prompts as token ids "
            "(text prompts, chat messages and stop strings need a tokenizer).",
            code="tokenizer_disabled",
            param=param,
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


def _render_chat(
    tokenizer: TokenizerLike, messages: list[dict[str, Any]], tools: list[Any] | None = None
) -> list[int]:
    try:
        if tools:  # only then: a tokenizer without tool support still renders plain chats
            return tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools)
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    except ValueError as e:  # ChatTemplateError: templates refuse some message orders
        raise bad_request(
            f"The chat template rejected these messages: {e}",
            code="invalid_messages",
            param="messages",
        ) from e


def _token_text(engine: RoleService, as_ids: bool | None = False) -> Any:
    if as_ids or not _has_text(engine):
        return lambda token_id: f"token_id:{token_id}"
    tok = engine.tokenizer
    return lambda token_id: tok.decode([token_id])


__all__ = ["DEFAULT_MAX_BODY_BYTES", "build_app", "serve"]
