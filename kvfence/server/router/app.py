"""The router's FastAPI app: health and metrics of its own, and the OpenAI routes, each relayed
to a decode after the first door (auth) and the body limit."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvfence.server.errors import install_handlers
from kvfence.server.httpio import read_body
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
) -> FastAPI:
    """The router app. Its lifespan opens the HTTP clients, runs one health round, then polls."""
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
    )
    state = RouterState(prefill, decode, api_keys, settings)

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

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = state.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    async def relay_post(request: Request) -> Response:
        # First door: a bad key never costs a worker anything.
        state.auth.tenant_for(request.headers.get("authorization"))
        body = await read_body(request, settings.max_body_bytes)
        return Relay(state, "POST", request.url.path, body, request_headers(request), paired=True)

    async def relay_get(request: Request) -> Response:
        state.auth.tenant_for(request.headers.get("authorization"))
        route = request.scope["route"].path if "route" in request.scope else None
        return Relay(
            state,
            "GET",
            request.url.path,
            b"",
            request_headers(request),
            paired=False,
            route=route,
        )

    app.add_api_route("/v1/completions", relay_post, methods=["POST"])
    app.add_api_route("/v1/chat/completions", relay_post, methods=["POST"])
    app.add_api_route("/v1/models", relay_get, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", relay_get, methods=["GET"])
    return app
