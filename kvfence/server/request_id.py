"""The client's `X-Request-Id`: checked (bounded length and charset), echoed on the response and
put in the request's log line, as vLLM's clients expect. It is only a label: kvfence mints its
own 128-bit request ids, which become PD room ids (I8), and never uses the client's for anything."""

from __future__ import annotations

import json
import re

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.server.errors import bad_request

HEADER = "x-request-id"
_RAW_HEADER = HEADER.encode("ascii")
SCOPE_KEY = "kvfence.client_request_id"
MAX_LEN = 128
# UUIDs, ULIDs, base64 and dotted trace ids pass; spaces, quotes and control bytes (log forging,
# header splitting on the way back) do not.
_VALID = re.compile(rf"[A-Za-z0-9._~:+/=@-]{{1,{MAX_LEN}}}")


def client_request_id(scope: Scope) -> str:
    """The validated client id of this request, or "-" when it sent none."""
    return str(scope.get(SCOPE_KEY) or "-")


class RequestIdMiddleware:
    """Pure ASGI (streams stay streams): a bad or repeated X-Request-Id is a 400 before any route
    runs; a good one comes back on the response, replacing any upstream's copy (the router
    relays a decode's headers)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).getlist(HEADER)
        if not given:
            await self.app(scope, receive, send)
            return
        if len(given) > 1 or not _VALID.fullmatch(given[0]):
            await _reject(send)
            return
        value = given[0]
        scope[SCOPE_KEY] = value
        raw = value.encode("ascii")

        async def echo(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() != _RAW_HEADER]
                message = {**message, "headers": [*kept, (_RAW_HEADER, raw)]}
            await send(message)

        await self.app(scope, receive, echo)


async def _reject(send: Send) -> None:
    err = bad_request(
        f"X-Request-Id must be one header of 1-{MAX_LEN} characters from "
        "A-Z a-z 0-9 . _ ~ : + / = @ -",
        code="invalid_request_id",
    )
    body = json.dumps(err.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


__all__ = ["HEADER", "MAX_LEN", "RequestIdMiddleware", "client_request_id"]
