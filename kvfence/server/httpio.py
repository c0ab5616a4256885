"""HTTP plumbing shared by an engine node's server and the router: the uvicorn config (with a
deadline for a request's headers), a server that prints one ready line once it listens, and a
request-body reader bounded by a byte limit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from fastapi import Request
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvfence.server.errors import APIError, bad_request

# A client gets this long to send a request's headers, from the connection's first byte or from
# the first byte of its next request on a kept-alive connection. uvicorn has no such deadline: a
# client dripping one header byte at a time held a connection forever (slowloris).
HEADER_TIMEOUT_S = 10.0


class _HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for the request line and headers."""

    header_timeout: float | None = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm()  # a request has started and its headers are not complete yet
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self.header_timeout is not None and self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def server_config(
    app: Any, *, header_timeout: float | None = HEADER_TIMEOUT_S, **kwargs: Any
) -> uvicorn.Config:
    """uvicorn's config for kvfence's servers (h11 with the header deadline); kwargs as
    uvicorn.Config's. header_timeout=None turns the deadline off (tests' twin only)."""
    protocol = type("HeaderDeadline", (_HeaderDeadline,), {"header_timeout": header_timeout})
    return uvicorn.Config(app, http=protocol, access_log=False, **kwargs)


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


__all__ = ["HEADER_TIMEOUT_S", "ReadyServer", "read_body", "server_config"]
