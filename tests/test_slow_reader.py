"""A client that does not read its stream cannot make the server buffer its whole answer: past a
bound of waiting events the request is aborted (slot and pages back at once) and the stream ends
in a slow_reader error. Twin: unbounded_output."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import h11
import uvicorn
from fake_engine import FakeEngine
from waiting import wait_for

from kvfence.engine.request import FinishReason, GenerateRequest, SamplingParams
from kvfence.faults import Faults
from kvfence.server.api import build_app
from kvfence.server.app_state import MAX_BUFFERED_EVENTS, Generation
from kvfence.server.httpio import server_config

TOKENS = 400
BOUND = 16


async def _never_read(faults: Faults) -> tuple[FakeEngine, Generation]:
    engine = FakeEngine(context_length=1024, pool_tokens=4096)
    engine.start()
    try:
        req = GenerateRequest("r0", "t", (65, 66, 67), SamplingParams(max_tokens=TOKENS))
        gen = Generation(engine, [req], faults, max_buffered=BOUND)
        assert await gen.submit() is None
        # The reader never calls next_event: wait until the server gave up on it, or until the
        # whole answer is waiting for it.
        deadline = time.monotonic() + 30
        while not (gen.overflowed or gen._queue.qsize() == TOKENS):
            assert time.monotonic() < deadline, f"neither: {gen._queue.qsize()} events queued"
            await asyncio.sleep(0.01)
        return engine, gen
    finally:
        engine.shutdown()


def test_a_reader_that_never_reads_is_aborted_with_a_bounded_buffer() -> None:
    async def scenario() -> None:
        engine, gen = await _never_read(Faults())
        assert engine.aborted == ["r0"]
        assert gen._queue.qsize() <= BOUND
        event = await gen.next_event()
        assert event is not None
        _, out = event
        assert out.finish_reason is FinishReason.ERROR and out.error_code == "slow_reader"

    asyncio.run(scenario())


def test_twin_unbounded_output_buffers_the_whole_answer() -> None:
    async def scenario() -> None:
        faults = Faults()
        with faults.injected("unbounded_output"):
            engine, gen = await _never_read(faults)
        assert engine.aborted == []
        assert gen._queue.qsize() == TOKENS

    asyncio.run(scenario())


# The real-socket case. What the kernel holds for a reader that never reads is pinned, not left to
# the host's autotuning: the client's receive buffer is set before connect (it sizes the window it
# advertises) and the server's send buffer on the listener (accepted sockets inherit it). Both are
# then a few KiB, uvicorn's transport pauses at 64 KiB, so well under 1,000 events of this size fit
# before the handler blocks on send; the answer is SOCKET_TOKENS events, several times what the
# buffers and the bound hold together, so only the bound can end it early.
SOCKET_BUFFER = 4096
SOCKET_TOKENS = 5000


@contextmanager
def _never_reading_client(faults: Faults) -> Iterator[tuple[FakeEngine, _Answer]]:
    """A server over the real HTTP app, and a client that sent a streaming request (big events:
    logprobs) and has not read a byte of the answer."""
    engine = FakeEngine(context_length=SOCKET_TOKENS + 100, pool_tokens=SOCKET_TOKENS + 1000)
    engine.start()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    app = build_app(engine, api_keys=None, faults=faults)
    server = uvicorn.Server(server_config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    client = socket.socket()
    try:
        wait_for(lambda: server.started, 30, "the server never started")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        client.connect(("127.0.0.1", port))
        body = json.dumps(
            {
                "model": "fake-model",
                "prompt": "slow reader " * 4,
                "max_tokens": SOCKET_TOKENS,
                "stream": True,
                "logprobs": 5,
            }
        ).encode()
        http = h11.Connection(h11.CLIENT)
        headers = [("host", "x"), ("content-type", "application/json")]
        headers.append(("content-length", str(len(body))))
        request = h11.Request(method="POST", target="/v1/completions", headers=headers)
        client.sendall(
            http.send(request) + http.send(h11.Data(body)) + http.send(h11.EndOfMessage())
        )
        # Settled: aborted (the slot is freed on the engine's next step, so wait for that too),
        # or the whole answer generated.
        wait_for(
            lambda: engine.submitted and not engine.stats().running,
            60,
            lambda: f"the request neither finished nor was aborted ({engine.rejected})",
        )
        yield engine, _Answer(client, http)
    finally:
        client.close()
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()


class _Answer:
    """The HTTP answer waiting on the client's socket, read only when a test says so."""

    def __init__(self, sock: socket.socket, http: h11.Connection) -> None:
        self.sock, self.http = sock, http

    def read(self) -> tuple[int, bytes]:
        """The status and the whole body (a stream's events, or an error's JSON)."""
        self.sock.settimeout(30)
        status, body = 0, b""
        while True:
            event = self.http.next_event()
            if event is h11.NEED_DATA:
                self.http.receive_data(self.sock.recv(1 << 16))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, body
            else:
                raise AssertionError(f"the answer ended early ({event}): ...{body[-300:]!r}")


def test_a_client_that_never_reads_its_socket_is_aborted_not_buffered() -> None:
    """The same over a real socket: the client's and server's socket buffers fill, the handler
    blocks on send, events pile up behind it until the bound, and the request is aborted; once
    the client reads, its stream ends in the slow_reader error, never [DONE] (I5). On a starved
    event loop the engine can outrun the handler by the bound before the first event is out:
    then the same abort answers with the error's status instead of a stream (I5's other half)."""
    with _never_reading_client(Faults()) as (engine, answer):
        assert engine.aborted == [engine.submitted[0].request_id], "the request was not aborted"
        stats = engine.stats()  # the slot and its pages are back
        assert stats.running == 0 and stats.pages_used == 0
        status, body = answer.read()
    if status != 200:
        assert status == 429 and json.loads(body)["error"]["code"] == "slow_reader", body
        return
    events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    assert b"slow_reader" in events[-1], f"the stream did not end in the error: {events[-1]!r}"
    assert b"[DONE]" not in body
    # What reached the client is what the socket buffers held (the queue behind them was dropped
    # with the answer); with the bound, that must leave most of the answer ungenerated.
    assert len(events) + MAX_BUFFERED_EVENTS < SOCKET_TOKENS, f"{len(events)} events got through"


def test_twin_unbounded_output_a_client_that_never_reads_makes_the_server_hold_it_all() -> None:
    with (
        Faults().injected("unbounded_output") as faults,
        _never_reading_client(faults) as (engine, answer),
    ):
        assert engine.aborted == [], "the request was aborted without the bound"
        # The whole answer was generated while the client read none of it: all but what the
        # socket buffers took sat in the server's memory, and now comes out in full.
        status, body = answer.read()
    assert status == 200
    assert body.count(b'"tokens"') == SOCKET_TOKENS
    assert body.endswith(b"data: [DONE]\n\n")
