"""Stand-in prefill/decode workers for the router and `up` tests: /health, /pd/info, /v1/models and
scripted /v1/* answers, in-process (uvicorn in a thread) or as a process (`python THIS serve ...`).

A request's behaviour is its prompt (or last chat message): "error400", "die" (stream cut after
one event), "die-json" (body cut mid-way), "hang" (one event, then wait for the hang-up), "hold"
(no status until the hang-up), "gated" (one event, then wait for FakeState.gate), else an answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from waiting import poll

from kvfence.lifetime import die_with_parent_from_env
from kvfence.tools.ports import free_port  # noqa: F401  (the tests take it from here)

# `up` tests: a worker of this role exits at start-up, as a real one does on a bad pool size.
EXIT_ROLE_ENV = "KVFENCE_FAKE_EXIT_ROLE"
EXIT_CODE = 3
# ... or listens but never turns healthy, as one does that refuses to pair.
UNHEALTHY_ROLE_ENV = "KVFENCE_FAKE_UNHEALTHY_ROLE"


@dataclass
class FakeState:
    role: str
    name: str
    bootstrap_port: int | None = None
    model: str = "fake-model"
    healthy: bool = True
    health_error: str = "engine loop is not running"
    requests: list[dict[str, Any]] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)  # prompts whose client hung up
    gate: threading.Event = field(default_factory=threading.Event)
    open_requests: int = 0


def _event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(name: str, text: str) -> dict[str, Any]:
    return {"object": "text_completion", "worker": name, "choices": [{"index": 0, "text": text}]}


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1].get("content", ""))
    if "input" in body:  # /v1/responses
        return str(body["input"])
    return str(body.get("prompt", ""))


class _CutBody(Response):
    """Announces a long body, sends half of it and fails: the peer sees a connection cut."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", b"1000")]})
        await send({"type": "http.response.body", "body": b'{"choices": [', "more_body": True})
        raise RuntimeError("fake decode died mid-body")


def make_app(
    role: str, name: str, *, bootstrap_port: int | None = None, model: str = "fake-model"
) -> FastAPI:
    fake = FakeState(role, name, bootstrap_port, model)
    app = FastAPI()
    app.state.fake = fake

    @app.get("/health")
    async def health() -> JSONResponse:
        if fake.healthy:
            return JSONResponse({"status": "ok"})
        err = {"message": fake.health_error, "type": "server_error", "param": None,
               "code": "engine_dead"}
        return JSONResponse({"error": err}, status_code=503)

    @app.get("/pd/info")
    async def pd_info() -> JSONResponse:
        prefill = fake.role == "prefill"
        return JSONResponse({
            "role": fake.role,
            "bootstrap_host": "127.0.0.1" if prefill else None,
            "bootstrap_port": fake.bootstrap_port if prefill else None,
            "model": fake.model, "context_length": 4096, "page_size": 16,
        })

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        fake.requests.append({"path": "/v1/models", "headers": dict(request.headers)})
        return JSONResponse({"object": "list", "data": [{"id": fake.model, "worker": name}]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        fake.requests.append({"path": request.url.path, "headers": dict(request.headers)})
        if model_id != fake.model:
            err = {"message": "The model does not exist.", "type": "invalid_request_error",
                   "param": "model", "code": "model_not_found"}
            return JSONResponse({"error": err}, status_code=404)
        return JSONResponse({"id": model_id, "object": "model", "worker": name})

    async def generate(request: Request) -> Response:
        raw = await request.body()
        fake.requests.append(
            {"path": request.url.path, "headers": dict(request.headers), "body": raw}
        )
        body = json.loads(raw)
        prompt = _prompt(body)
        if prompt == "error400":
            err = {"message": "This model's maximum context length is 4096 tokens.",
                   "type": "invalid_request_error", "param": "prompt",
                   "code": "context_length_exceeded"}
            return JSONResponse({"error": err}, status_code=400)
        if prompt in ("prefill-draining", "prefill-gone"):  # what a decode says for its prefill
            code = "draining" if prompt == "prefill-draining" else "prefill_unavailable"
            err = {"message": "lost the prefill worker", "type": "server_error", "param": None,
                   "code": code}
            return JSONResponse({"error": err}, status_code=503)
        if prompt == "die-json":
            return _CutBody()
        if prompt == "hold":
            fake.open_requests += 1
            try:
                while not await request.is_disconnected():
                    await asyncio.sleep(0.02)
                fake.disconnects.append(prompt)
            finally:
                fake.open_requests -= 1
            return Response(status_code=499)
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "worker": name,
                                 "choices": [{"index": 0, "text": f"answer from {name}"}]})
        return StreamingResponse(_stream(fake, prompt), media_type="text/event-stream")

    app.add_api_route("/v1/completions", generate, methods=["POST"])
    app.add_api_route("/v1/chat/completions", generate, methods=["POST"])
    app.add_api_route("/v1/responses", generate, methods=["POST"])
    for path in ("/tokenize", "/detokenize"):
        app.add_api_route(path, generate, methods=["POST"])
    return app


async def _stream(fake: FakeState, prompt: str) -> AsyncIterator[bytes]:
    fake.open_requests += 1
    try:
        yield _event(_chunk(fake.name, "one"))
        if prompt == "die":
            raise RuntimeError("fake decode died mid-stream")
        if prompt == "hang":
            await asyncio.sleep(30)
        if prompt == "gated":
            while not fake.gate.is_set():
                await asyncio.sleep(0.01)
        yield _event(_chunk(fake.name, " two"))
        yield b"data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        fake.disconnects.append(prompt)
        raise
    finally:
        fake.open_requests -= 1


class ServerThread:
    """One ASGI app on a free localhost port, served by uvicorn in a daemon thread."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="critical", access_log=False,
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        started = poll(lambda: self.server.started or not self._thread.is_alive(), 10)
        if not (started and self.server.started):
            raise RuntimeError(f"server on port {self.port} did not start")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=5)


def stop_all(servers: list[ServerThread]) -> None:
    """Stops servers together: each takes a few event-loop ticks to notice, so overlap them."""
    for s in servers:
        s.server.should_exit = True
    for s in servers:
        s._thread.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    """Process mode: accepts `serve` and the worker flags `kvfence up` passes, ignores the rest.
    Like a real worker's entry (kvfence/cli.py), it dies with the `up` that started it."""
    die_with_parent_from_env()
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["serve"])
    p.add_argument("--disaggregation-mode", default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--model", default="fake-model")
    args, _ = p.parse_known_args(argv)
    role = args.disaggregation_mode
    if os.environ.get(EXIT_ROLE_ENV) == role:
        print(f"fake {role}: refusing to start (pool too small)", flush=True)
        return EXIT_CODE
    model = args.served_model_name or os.path.basename(args.model.rstrip("/"))
    app = make_app(role, f"{role}@{args.port}", bootstrap_port=args.disaggregation_bootstrap_port,
                   model=model)
    if os.environ.get(UNHEALTHY_ROLE_ENV) == role:
        app.state.fake.healthy = False
        app.state.fake.health_error = "pairing refused: page_size differs"
    print(f"fake {role} ready on {args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
