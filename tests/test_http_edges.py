"""The HTTP door holds under abuse before any authentication: a client that drips its request
headers (slowloris) loses its connection after the header deadline, on the config every kvfence
server (node and router) runs with. No time is asserted: each wait is bounded and says why."""

from __future__ import annotations

import http.client
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from waiting import wait_for

from kvfence.server.httpio import server_config


def _serve(header_timeout: float | None) -> tuple[uvicorn.Server, int]:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        server_config(
            app, host="127.0.0.1", port=port, log_level="critical", header_timeout=header_timeout
        )
    )
    threading.Thread(target=server.run, daemon=True).start()
    wait_for(lambda: server.started, 30, "test server did not start")
    return server, port


def _drip(port: int, seconds: float) -> bool:
    """Sends a never-ending header, a line every 50 ms, for up to `seconds`; True when the
    server closed the connection meanwhile."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        c.settimeout(0.05)
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            try:
                c.sendall(f"X-Drip-{i}: a\r\n".encode())
                if c.recv(1024) == b"":
                    return True
            except TimeoutError:
                pass
            except OSError:  # reset or broken pipe: closed by the server
                return True
            i += 1
        return False


def test_dripped_headers_lose_the_connection_after_the_deadline() -> None:
    server, port = _serve(header_timeout=0.5)
    try:
        assert _drip(port, seconds=60), "a dripping client still held its connection after 60 s"
        # ... and a well-behaved client on the same server is served, twice on one connection.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        for _ in range(2):
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b'{"status":"ok"}')
        conn.close()
    finally:
        server.should_exit = True


def test_twin_without_the_deadline_the_dripping_client_keeps_its_connection() -> None:
    # The same client against uvicorn's own behaviour (no header deadline): still connected after
    # six times the deadline the guarded server enforces, so the test above can fail.
    server, port = _serve(header_timeout=None)
    try:
        assert not _drip(port, seconds=3.0)
    finally:
        server.should_exit = True
