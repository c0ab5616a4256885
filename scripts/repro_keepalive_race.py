"""Reproduces the flaky leakcheck ReadError against a real uvicorn (h11, as `kvfence serve` runs
it): uvicorn closes a keep-alive connection idle for its timeout while the client's next request
sits unread in the socket buffer, so the kernel resets it and httpx raises a ReadError for a
request the server application never saw. A late server process (a loaded 2-core machine) is
emulated by one 0.5 s stall queued just before the keep-alive timer fires (it reads uvicorn's
private timer handle: a demonstration, not a test; tests/test_leakcheck_keepalive.py is the
regression test). Prints the outcome with httpx's default expiry (5 s, as long as uvicorn's
timeout) and with one well under it:

    .venv/bin/python scripts/repro_keepalive_race.py 18777
"""

import asyncio
import sys
import threading
import time

import httpx
import uvicorn

KEEPALIVE = 1.0


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    loop = asyncio.get_running_loop()
    if scope["path"] == "/arm":

        def find() -> None:
            for h in loop._scheduled:  # the keep-alive timer of the /arm connection
                if getattr(h._callback, "__name__", "") == "timeout_keep_alive_handler":
                    due = h.when()

                    def stall_then(due: float = due) -> None:
                        loop.call_soon(lambda: time.sleep(0.5))  # runs before the timer
                        while loop.time() < due:
                            pass

                    loop.call_at(due - 0.01, stall_then)
                    return

        loop.call_later(0.1, find)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain")],
        }
    )
    await send({"type": "http.response.body", "body": b"ok"})


def serve(port: int) -> None:
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        timeout_keep_alive=KEEPALIVE,
        http="h11",
        loop="asyncio",
    )


async def client(port: int, expiry: float) -> str:
    limits = httpx.Limits(max_keepalive_connections=8, keepalive_expiry=expiry)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as c:
        await c.get("/arm")
        await asyncio.sleep(KEEPALIVE + 0.2)  # inside the server's stall
        try:
            async with c.stream("POST", "/next", json={"stream": True}) as r:
                await r.aread()
                return f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}"


if __name__ == "__main__":
    port = int(sys.argv[1])
    threading.Thread(target=serve, args=(port,), daemon=True).start()
    time.sleep(1.0)
    for expiry in (5.0, 0.5):  # httpx's default keepalive_expiry, then one well under the server's
        print(f"client keepalive_expiry={expiry}: {asyncio.run(client(port, expiry))}")
