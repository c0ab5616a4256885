"""kvfence/sse.py, the one event-stream reader: the same events however the bytes are cut, CRLF /
CR / LF, comments, multi-line data, [DONE], and `split` handing out only whole events."""

from __future__ import annotations

import asyncio
import random

from kvfence.sse import Event, SSEParser, aiter_events, iter_events

STREAM = (
    b": keep-alive ping\r\n\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: note\rdata: line one\rdata: line two\r\r"
    b"id: 7\ndata:no-space\n\n"
    b"data\n\n"  # a field with no colon: empty data
    b"retry: 10\n\n"  # no data: not dispatched
    b"data: [DONE]\n\n"
)
EXPECTED = [
    Event('{"a": 1}'),
    Event("line one\nline two", event="note"),
    Event("no-space", id="7"),
    Event("", id="7"),
    Event("[DONE]", id="7"),
]


def test_events_of_a_whole_stream() -> None:
    events = SSEParser().feed(STREAM)
    assert events == EXPECTED
    assert events[0].json() == {"a": 1} and events[-1].done and not events[0].done


def test_any_cut_of_the_bytes_gives_the_same_events() -> None:
    rng = random.Random(1)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 12)))
        pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
        assert list(iter_events(pieces)) == EXPECTED, cuts
    # Byte by byte, including a CRLF split between two pieces.
    assert list(iter_events([STREAM[i : i + 1] for i in range(len(STREAM))])) == EXPECTED


def test_split_hands_out_whole_events_only() -> None:
    parser = SSEParser()
    out = b""
    for i in range(0, len(STREAM), 5):
        ready, _ = parser.split(STREAM[i : i + 5])
        out += ready
        # Whatever was handed out so far is whole events (a final lone CR may await its LF).
        check = SSEParser()
        check.feed(out + b"\n")
        assert check.pending == b"", out
    assert out == STREAM and parser.pending == b""


def test_an_unfinished_event_is_not_dispatched() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"cut": tr') == [] and parser.pending == b'data: {"cut": tr'
    assert parser.feed(b"ue}\n") == [] and parser.feed(b"\n") == [Event('{"cut": true}')]


def test_async_reader() -> None:
    async def pieces():  # type: ignore[no-untyped-def]
        for i in range(0, len(STREAM), 3):
            yield STREAM[i : i + 3]

    async def collect() -> list[Event]:
        return [e async for e in aiter_events(pieces())]

    assert asyncio.run(collect()) == EXPECTED
