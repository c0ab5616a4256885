"""A client that does not read its stream cannot make the server buffer its whole answer: past a
bound of waiting events the request is aborted (slot and pages back at once) and the stream ends
in a slow_reader error. Twin: unbounded_output."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from fake_engine import FakeEngine

from kvfence.engine.request import FinishReason, GenerateRequest, SamplingParams
from kvfence.faults import Faults
from kvfence.server.app_state import Generation

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


# Flaky in CI (failed once in a fresh-clone run at 6ff5038): depends on kernel socket buffers.
# The bound and its twin stay in CI through the Generation tests above; find the cause, then
# bring this back.
@pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="flaky, under investigation: RUN_SLOW=1")
def test_a_client_that_never_reads_its_socket_is_aborted_not_buffered() -> None:
    """The same over a real socket: the client sends a streaming request and never reads a byte.
    The kernel's and uvicorn's buffers fill, the handler blocks on send, events pile up behind it
    until the bound, and the request is aborted."""
    import json
    import socket
    import threading

    import uvicorn
    from waiting import wait_for

    from kvfence.server.api import build_app

    engine = FakeEngine(context_length=70_000, pool_tokens=80_000)
    engine.start()
    server = uvicorn.Server(
        uvicorn.Config(build_app(engine, api_keys=None), host="127.0.0.1", port=0,
                       log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    sock = socket.socket()
    try:
        wait_for(lambda: server.started, 30, "the server never started")
        port = server.servers[0].sockets[0].getsockname()[1]
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that stalls early
        sock.connect(("127.0.0.1", port))
        body = json.dumps({"model": "fake-model", "prompt": "slow reader " * 4,
                           "max_tokens": 65_000, "stream": True,
                           # Big events: the kernel's socket buffers hold few of them.
                           "logprobs": 5}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        # Never read: without the bound the engine would run all 65,000 tokens into memory.
        wait_for(lambda: engine.submitted and (engine.aborted or not engine.stats().running),
                 60, lambda: f"the request neither finished nor was aborted ({engine.rejected})")
        assert len(engine.aborted) == 1, "the non-reading client's request was not aborted"
        assert engine.stats().running == 0
    finally:
        sock.close()
        server.should_exit = True
        thread.join(timeout=10)
        engine.shutdown()
