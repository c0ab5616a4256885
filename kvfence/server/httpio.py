"""HTTP plumbing shared by an engine node's server and the router: a uvicorn server that prints one
ready line once it listens, and a request-body reader bounded by a byte limit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import Request
from starlette.requests import ClientDisconnect

from kvfence.server.errors import APIError, bad_request


class ReadyServer(uvicorn.Server):
    """Prints `ready(port)` once the socket listens, so scripts and people know when to send.
    The port is the one bound, which differs from the configured one when that was 0."""

    def __init__(self, config: uvicorn.Config, ready: Callable[[int], str]) -> None:
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for server in self.servers:
                for sock in server.sockets:
                    port = sock.getsockname()[1]
            print(self._ready(port), flush=True)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(
        413,
        f"Request body is larger than the {limit}-byte limit (at least {size} bytes).",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as more than `limit` bytes are declared or arrive."""
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
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise _too_large(received, limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody will read this; it only keeps a hang-up out of the error log.
        raise APIError(400, "Client disconnected.", code="client_disconnected") from None
    return b"".join(chunks)


__all__ = ["ReadyServer", "read_body"]
