"""A client that does not read its stream cannot make the server buffer its whole answer: past a
bound of waiting events the request is aborted (slot and pages back at once) and the stream ends
in a slow_reader error. Twin: unbounded_output."""

from __future__ import annotations

import asyncio
import time

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
