"""The per-app state of the HTTP layer, and the bridge that carries one HTTP request's generations
from the engine thread onto the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive

from kvfence.engine.admission import Rejected
from kvfence.engine.engine import Engine
from kvfence.engine.outbox import Batch, StepOutbox
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput
from kvfence.faults import Faults
from kvfence.role import RoleService
from kvfence.server.auth import Authenticator
from kvfence.server.drain import Drain
from kvfence.server.hop import HopVerifier
from kvfence.server.metrics import ServerMetrics
from kvfence.server.operator import OperatorGate

log = logging.getLogger(__name__)
# An output's way onto the event loop: the loop its Generation lives on, and what takes it there.
Deliver = tuple[asyncio.AbstractEventLoop, Callable[[RequestOutput], None]]


def _to_loops(batch: Batch[Deliver]) -> None:
    """A step's outputs onto their loops: one wake-up of each loop, not one per token of every
    stream (on a 2-core host each wake-up is a syscall here and a GIL hand-over there)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable[..., None], RequestOutput]]] = {}
    for (loop, deliver), out in batch:
        by_loop.setdefault(loop, []).append((deliver, out))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # loop closed: server gone, engine lives on
            loop.call_soon_threadsafe(_deliver_all, items)


def _deliver_all(items: list[tuple[Callable[..., None], RequestOutput]]) -> None:
    for deliver, out in items:
        try:
            deliver(out)
        except Exception:  # one stream's failure must not cost the others their outputs
            log.exception("delivering an output failed")


def step_outbox(engine: RoleService) -> StepOutbox[Deliver]:
    """The outbox an app's streams share: an in-process engine's outputs leave at the end of its
    step; any other (an engine process's pipe reader, a test double) at once."""
    outbox: StepOutbox[Deliver] = StepOutbox(_to_loops)
    inner = getattr(engine, "engine", None)
    if isinstance(inner, Engine):
        inner.step_end_hooks.append(outbox.step_done)
    return outbox


@dataclass
class AppState:
    engine: RoleService
    auth: Authenticator
    metrics: ServerMetrics
    max_body_bytes: int
    faults: Faults
    drain: Drain
    operator: OperatorGate
    hop: HopVerifier
    outbox: StepOutbox[Deliver]


_CLIENT_GONE = object()
# Events (one per token per choice) a stream may have waiting for its reader. A reader slower
# than the engine would otherwise make the server hold its whole answer; past this, the request
# is aborted (its slot and pages go back at once) and its stream ends in a slow_reader error.
# Aborting, not pausing: a paused request would keep its running slot and pages while its
# reader dawdles, which is the starvation the fair share exists to prevent.
MAX_BUFFERED_EVENTS = 512

Event = tuple[int, RequestOutput]


class Generation:
    """The engine requests behind one HTTP request (prompts x n), seen as one asyncio stream of
    (choice index, output) events. close() aborts whatever has not finished; it is idempotent
    and every exit path calls it, so a client that goes away never leaves work in the engine."""

    def __init__(
        self,
        engine: RoleService,
        requests: list[GenerateRequest],
        faults: Faults | None = None,
        max_buffered: int = MAX_BUFFERED_EVENTS,
        on_close: Callable[[Generation], None] | None = None,
        outbox: StepOutbox[Deliver] | None = None,
    ) -> None:
        self.engine = engine
        # Without the app's outbox (a Generation made alone), one of its own: no engine thread
        # names itself to it, so every output goes onto the loop at once.
        self._outbox = outbox if outbox is not None else StepOutbox(_to_loops)
        self._on_close = on_close
        self._faults = faults if faults is not None else Faults()
        self._max_buffered = max_buffered * max(1, len(requests))
        self.overflowed = False
        self.requests = requests
        self._index = {r.request_id: i for i, r in enumerate(requests)}
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = threading.Lock()  # guards _admitted/_closed against the submit thread
        self._admitted: list[str] = []
        self._aborted: set[str] = set()
        self._closed = False
        self._finished: set[int] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.client_gone = False

    def _sink(self, index: int) -> Callable[[RequestOutput], None]:
        # Runs on the engine thread: hand over and return; never touch the queue directly.
        return self._outbox.sink((self._loop, functools.partial(self._deliver, index)))

    def _deliver(self, index: int, out: RequestOutput) -> None:
        """On the loop: queue an output, unless the reader has fallen too far behind."""
        if self.overflowed:
            return  # the stream already ends in its error; later outputs have no reader
        bounded = self._faults.guards().on("output_bound")
        if self._queue.qsize() < self._max_buffered or not bounded:
            self._queue.put_nowait((index, out))
            return
        self.overflowed = True
        while not self._queue.empty():  # what it has not read is dropped with the answer
            self._queue.get_nowait()
        self.close_engine_side()
        self._queue.put_nowait((index, _slow_reader(out)))

    def _submit_all(self) -> Rejected | None:
        for index, req in enumerate(self.requests):
            result = self.engine.submit(req, self._sink(index))
            if isinstance(result, Rejected):
                # I1: the rejected one holds nothing; its admitted siblings must not linger.
                self.close_engine_side()
                return result
            with self._lock:
                self._admitted.append(req.request_id)
                closed = self._closed
            if closed:  # close() ran while we were submitting and could not see this one
                self.engine.abort(req.request_id)
        return None

    async def submit(self) -> Rejected | None:
        # Admission runs in the caller's thread and may wait on the engine's lock: not this loop.
        fut = self._loop.run_in_executor(None, self._submit_all)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda _: self.close_engine_side())
            raise

    def watch_disconnect(self, receive: Receive) -> None:
        """Abort as soon as the client hangs up, even while no token is flowing."""

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
            if not self.all_finished:
                self.client_gone = True
                self.close_engine_side()
                self._queue.put_nowait(_CLIENT_GONE)

        self._watcher = asyncio.create_task(watch())

    @property
    def all_finished(self) -> bool:
        return len(self._finished) == len(self.requests)

    async def next_event(self) -> Event | None:
        """The next output of any choice, or None once the client has gone."""
        item = await self._queue.get()
        if item is _CLIENT_GONE:
            return None
        index, out = item
        if out.finished:
            self._finished.add(index)
        return index, out

    def close_engine_side(self) -> None:
        with self._lock:
            self._closed = True
            pending = [
                rid
                for rid in self._admitted
                if self._index[rid] not in self._finished and rid not in self._aborted
            ]
            self._aborted.update(pending)
        for rid in pending:
            self.engine.abort(rid)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        self.close_engine_side()
        if self._on_close is not None:
            self._on_close(self)


def _slow_reader(out: RequestOutput) -> RequestOutput:
    """The failed finish a stream ends with when its reader fell too far behind (I5: an error
    event, never a [DONE] after a cut answer)."""
    return RequestOutput(
        out.request_id,
        (),
        "",
        FinishReason.ERROR,
        out.prompt_tokens,
        out.completion_tokens,
        error=f"The client read its stream too slowly: more than {MAX_BUFFERED_EVENTS} events "
        "per choice were waiting for it, so the request was aborted.",
        error_code="slow_reader",
        error_status=429,
    )
