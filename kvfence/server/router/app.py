"""The router's FastAPI app: health and metrics of its own, and the OpenAI routes, each relayed
to a decode after the first door (auth) and the body limit."""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvfence.config import RoutingConfig
from kvfence.faults import Faults
from kvfence.server.auth import single_authorization
from kvfence.server.errors import APIError, install_handlers
from kvfence.server.httpio import read_body
from kvfence.server.request_id import RequestIdMiddleware
from kvfence.server.router.args import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_REQUEST_TIMEOUT_S,
    RouterSettings,
)
from kvfence.server.router.relay import Relay, request_headers
from kvfence.server.router.state import RouterState
from kvfence.server.router.workers import normalize_url

# A model id is a name, never a path: segments of [A-Za-z0-9._-] that start with a letter or
# digit (so no "." or ".." can walk up to a worker's internal routes), "/" between them (HF ids).
_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}"
_MODEL_ID = re.compile(rf"{_SEGMENT}(/{_SEGMENT}){{0,3}}")


def _model_path(model_id: str) -> str:
    """The upstream path for GET /v1/models/{model_id}, rebuilt from a validated id (the
    client's path, decoded, is never forwarded)."""
    if not _MODEL_ID.fullmatch(model_id):
        raise APIError(
            404,
            "The model does not exist.",
            code="model_not_found",
            type="invalid_request_error",
            param="model",
        )
    return "/v1/models/" + quote(model_id, safe="/")


def build_router_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    api_keys: dict[str, str] | None,
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    routing: RoutingConfig | None = None,
    faults: Faults | None = None,
    operator_key: str | None = None,
    shared_prefixes: Sequence[str | Sequence[int]] = (),
) -> FastAPI:
    """The router app. Its lifespan opens the HTTP clients, runs one health round, then polls.
    operator_key: reads the workers' /pd/info and /health, signs the prefill address each
    decode is given, and alone reads this router's /metrics and /health detail."""
    prefill = [normalize_url(u) for u in prefill_urls]
    decode = [normalize_url(u) for u in decode_urls]
    if not prefill or not decode:
        raise ValueError("the router needs at least one prefill and one decode worker")
    everyone = prefill + decode
    if len(set(everyone)) != len(everyone):
        raise ValueError("a worker URL is listed twice (each worker has exactly one role)")
    settings = RouterSettings(
        health_interval=health_interval,
        health_timeout=health_timeout,
        request_timeout=request_timeout,
        connect_timeout=connect_timeout,
        max_body_bytes=max_body_bytes,
        routing=routing or RoutingConfig(),
        shared_prefixes=tuple(p if isinstance(p, str) else tuple(p) for p in shared_prefixes),
    )
    state = RouterState(prefill, decode, api_keys, settings, faults, operator_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="kvfence router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.router = state
    install_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        # Workers, their addresses and the bootstrap ports are the operator's to see.
        detail = state.operator.is_operator(request.headers)
        ok, body = state.health() if detail else state.public_health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state.operator.require(request.headers)
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    def authenticate(request: Request) -> str:
        # First door: a bad key never costs a worker anything; two keys are refused, so the
        # worker sees the one key that was checked here (I6).
        return state.auth.tenant_for(single_authorization(request.headers.getlist("authorization")))

    # Only the routes below are relayed, each to a path built here, never the client's path.
    def relay_post(path: str, *, paired: bool = True) -> Any:
        async def handler(request: Request) -> Response:
            tenant = authenticate(request)
            body = await read_body(request, settings.max_body_bytes)
            # The tenant that routes the request is the key's, the same the worker will find.
            key = state.routing.key(tenant, path, body) if paired else None
            return Relay(
                state, "POST", path, body, request_headers(request), paired=paired, prefix=key
            )

        return handler

    async def list_models(request: Request) -> Response:
        authenticate(request)
        return Relay(state, "GET", "/v1/models", b"", request_headers(request), paired=False)

    async def get_model(request: Request, model_id: str) -> Response:
        authenticate(request)
        path = _model_path(model_id)
        return Relay(
            state,
            "GET",
            path,
            b"",
            request_headers(request),
            paired=False,
            route="/v1/models/{model_id:path}",
        )

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, relay_post(path), methods=["POST"])
    for path in ("/tokenize", "/detokenize"):
        # Tokenizer only: any healthy decode answers, no prefill is involved.
        app.add_api_route(path, relay_post(path, paired=False), methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    return app
