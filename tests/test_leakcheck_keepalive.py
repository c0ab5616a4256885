"""The flaky ReadError of test_kvfence_unified_serve_is_clean: a server closes a keep-alive
connection that has been idle for its timeout (uvicorn: 5 s, httpx's default expiry too); a
request sent on it just then is reset unread, and the client sees a ReadError for a request the
server never saw. leakcheck reuses no connection idle longer than KEEPALIVE_S, so it never sends
on one that a server with a longer timeout may be closing. The server here resets every second
request on a connection (a close racing that request, made certain), so the twin shows the
same two requests fail once the client keeps connections as long as the server does."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import pytest

from kvfence.tools.leakcheck import api as api_mod
from kvfence.tools.leakcheck.api import Api
from kvfence.tools.leakcheck.common import Tenant

BODY = b'{"id":"x","choices":[{"text":" ok"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


def _serve(listener: socket.socket, stop: threading.Event) -> None:
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(30)
            data = b""
            while b"\r\n\r\n" not in data:  # headers of the first request
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            while len(rest) < length:
                rest += conn.recv(65536)
            conn.sendall(RESPONSE)
            # The next request on this connection arrives while the server is closing it:
            # close with the request unread (SO_LINGER 0: a reset, as the kernel sends one).
            conn.recv(1, socket.MSG_PEEK)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _two_requests(port: int, idle_s: float) -> list[str | None]:
    api = Api(f"http://127.0.0.1:{port}", timeout=30)
    api.model = "m"
    tenant = Tenant("t", "k")
    try:
        first = await api.generate(tenant, "r", "hello", 1)
        await asyncio.sleep(idle_s)  # the connection sits idle in the pool this long
        second = await api.generate(tenant, "r", "hello", 1)
        return [first.error, second.error]
    finally:
        await api.close()


@pytest.mark.parametrize("twin", [False, True])
def test_no_request_goes_out_on_a_connection_idle_past_keepalive(
    twin: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if twin:  # the old client: pooled connections kept as long as uvicorn keeps them
        monkeypatch.setattr(api_mod, "KEEPALIVE_S", 5.0)
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    server = threading.Thread(target=_serve, args=(listener, stop), daemon=True)
    server.start()
    try:
        # 1.5 s idle: past leakcheck's expiry (1 s), within a 5 s server keep-alive.
        errors = asyncio.run(_two_requests(listener.getsockname()[1], 1.5))
    finally:
        stop.set()
        server.join(timeout=10)
        listener.close()
    if twin:
        assert errors[0] is None and errors[1] is not None, errors
        assert "ReadError" in errors[1] or "RemoteProtocolError" in errors[1], errors
    else:
        assert errors == [None, None], errors
