"""The one reader of server-sent events (`text/event-stream`) in kvfence: turns bytes, fed in
whatever pieces the network delivers, into complete events (multi-line `data:`, comments, CRLF /
CR / LF line ends, the OpenAI `[DONE]` sentinel). Clients (leakcheck, bench, chaos) iterate
events; a relay can use `split` to pass bytes on only at event boundaries."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


@dataclass(frozen=True)
class Event:
    """One dispatched event. `data` is the event's data lines joined by newlines."""

    data: str
    event: str | None = None
    id: str | None = None

    @property
    def done(self) -> bool:
        """OpenAI's end-of-stream sentinel (`data: [DONE]`)."""
        return self.data.strip() == DONE

    def json(self) -> Any:
        """The data as JSON; raises ValueError when it is not JSON."""
        return json.loads(self.data)


class SSEParser:
    """Incremental event-stream parser (the WHATWG rules a client needs): feed bytes, get the
    events completed so far; a partial line or event waits for the next feed."""

    def __init__(self) -> None:
        self._raw = b""  # bytes since the last event boundary
        self._at = 0  # how far into _raw lines have been parsed
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._last_id: str | None = None
        self._has_fields = False

    def feed(self, chunk: bytes) -> list[Event]:
        """The events that `chunk` completes (possibly none)."""
        return self.split(chunk)[1]

    def split(self, chunk: bytes) -> tuple[bytes, list[Event]]:
        """(the bytes up to and including the last complete event, the events they hold).

        For a relay: forwarding only the first part never leaves half an event downstream; the
        rest is kept and comes out of a later call once its event is complete."""
        self._raw += chunk
        events: list[Event] = []
        boundary = 0
        while (found := self._next_line()) is not None:
            line, end = found
            self._at = end
            if line:
                self._field(line)
                continue
            boundary = end  # a blank line ends an event (or is a stray separator)
            if self._has_fields and (ev := self._dispatch()) is not None:
                events.append(ev)
        ready, self._raw = self._raw[:boundary], self._raw[boundary:]
        self._at -= boundary
        return ready, events

    @property
    def pending(self) -> bytes:
        """Bytes received that are not yet part of a complete event (empty after a clean end)."""
        return self._raw

    def _next_line(self) -> tuple[bytes, int] | None:
        """(the next complete line, the offset just past its end), or None to wait for more."""
        buf, at = self._raw, self._at
        lf, cr = buf.find(b"\n", at), buf.find(b"\r", at)
        if cr < 0 or (0 <= lf < cr):
            return None if lf < 0 else (buf[at:lf], lf + 1)
        if cr + 1 == len(buf):
            return None  # a CR at the end may be the first half of a CRLF
        return buf[at:cr], cr + (2 if buf[cr + 1 : cr + 2] == b"\n" else 1)

    def _field(self, raw: bytes) -> None:
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(":"):
            return  # a comment (keep-alive pings)
        name, colon, value = line.partition(":")
        if colon:
            value = value.removeprefix(" ")
        self._has_fields = True
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value

    def _dispatch(self) -> Event | None:
        data, event, eid = self._data, self._event, self._id
        self._data, self._event, self._id, self._has_fields = [], None, None, False
        if eid is not None:
            self._last_id = eid
        if not data:
            return None  # an event with no data is not dispatched
        return Event("\n".join(data), event, eid if eid is not None else self._last_id)


def encode(obj: Any) -> bytes:
    """One `data:` event carrying obj as compact JSON (the writer's side, for servers)."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def iter_events(chunks: Iterable[bytes]) -> Iterator[Event]:
    """Events from a blocking byte stream (e.g. `httpx.Response.iter_bytes()`)."""
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)


async def aiter_events(chunks: AsyncIterable[bytes]) -> AsyncIterator[Event]:
    """Events from an async byte stream (e.g. `httpx.Response.aiter_bytes()`), each as soon as
    its blank line arrives (what a time-to-first-token measurement needs)."""
    parser = SSEParser()
    async for chunk in chunks:
        for event in parser.feed(chunk):
            yield event


__all__ = ["DONE", "Event", "SSEParser", "aiter_events", "iter_events"]
