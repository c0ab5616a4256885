"""Graceful drain of one node on SIGTERM: stop admitting at once (readiness turns 503, every door
answers a 503 that says so), let what was admitted finish within --drain-timeout, abort the rest
(their clients get the engine's 503, or an error event on a started stream: never a partial 200),
wait for the pool to hold nothing, then let the server exit."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn

from kvfence.config import ServerConfig
from kvfence.role import RoleService
from kvfence.server.httpio import ReadyServer

logger = logging.getLogger("kvfence.server")

DEFAULT_DRAIN_TIMEOUT_S = ServerConfig.drain_timeout  # --drain-timeout's default, one home
# On an answer whose request this node refused before any engine saw it (it is draining): the
# router may send that request to another worker, and no other.
NOT_ADMITTED_HEADER = "X-Kvfence-Not-Admitted"
# After the deadline's aborts: how long the pool gets to come back (an abort in PD waits for the
# peer's ABORT_ACK or a fenced connection). Bounded so a wedged peer cannot hold the exit.
ABORT_GRACE_S = 10.0
_POLL_S = 0.05


class Generation(Protocol):
    """What the drain needs of a live HTTP generation (kvfence/server/app_state.py's)."""

    def close_engine_side(self) -> None:
        """Abort what has not finished; its client gets the engine's 503."""
        ...


class Drain:
    """One node's drain: the flag every route reads, the node's live HTTP generations, and the
    wait for them and the engine to finish."""

    def __init__(self, service: RoleService, timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        if not timeout >= 0:
            raise ValueError("--drain-timeout must be >= 0")
        self.service = service
        self.timeout = timeout
        self.draining = False
        self._live: set[Generation] = set()

    def track(self, gen: Generation) -> None:
        self._live.add(gen)

    def untrack(self, gen: Generation) -> None:
        self._live.discard(gen)

    def begin(self) -> None:
        """Stop admitting now; idempotent. Runs on the event loop's thread (a signal handler)."""
        if not self.draining:
            self.draining = True
            self.service.stop_admitting()
            logger.info(
                "draining: admitting nothing new; %d request(s) in flight get %g s to finish",
                len(self._live),
                self.timeout,
            )

    def busy(self) -> bool:
        if self._live:
            return True
        try:
            s = self.service.stats()
        except Exception:  # an engine that died holds nothing we could wait for
            logger.exception("stats failed while draining")
            return False
        return bool(s.running or s.waiting or s.handoff or s.pages_used)

    async def run(self) -> None:
        """Until the node is idle, aborting what outlives the deadline. Returns when it is safe
        to close the listener."""
        self.begin()
        start = time.monotonic()
        in_flight = len(self._live)
        await self._idle_by(start + self.timeout)
        aborted = len(self._live)
        for gen in list(self._live):
            gen.close_engine_side()  # each client gets the engine's 503, never a partial 200
        idle = await self._idle_by(time.monotonic() + ABORT_GRACE_S)
        held = self._pages_used()
        logger.info(
            "drained in %.1f s: %d request(s) in flight at SIGTERM, %d finished, %d aborted "
            "with a 503; pages still held: %d%s",
            time.monotonic() - start,
            in_flight,
            max(0, in_flight - aborted),
            aborted,
            held,
            "" if idle else " (gave up waiting; the transfer protocol fences the rest)",
        )

    async def _idle_by(self, deadline: float) -> bool:
        while self.busy():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(_POLL_S)
        return True

    def _pages_used(self) -> int:
        try:
            return int(self.service.stats().pages_used)
        except Exception:
            return -1


class DrainingServer(ReadyServer):
    """The node's uvicorn: the first SIGTERM drains (listener open, readiness 503) and then
    exits; a second SIGTERM, or SIGINT, exits at once as uvicorn always does."""

    def __init__(
        self, config: uvicorn.Config, ready: Callable[[int], str], drain: Drain
    ) -> None:
        super().__init__(config, ready)
        self.drain = drain
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.drain.draining or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised after run(): the caller's shutdown path
        self.drain.begin()
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run()
        finally:
            self.should_exit = True


__all__ = ["DEFAULT_DRAIN_TIMEOUT_S", "NOT_ADMITTED_HEADER", "Drain", "DrainingServer"]
