"""Outputs held until the end of the engine's step and handed on as one batch, for a sink whose
crossing costs (the engine process's pipe, the HTTP server's event loop): it is paid once a step
instead of once a token of every stream."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from kvfence.engine.request import RequestOutput

K = TypeVar("K")
Batch = list[tuple[K, RequestOutput]]


class StepOutbox(Generic[K]):
    """Outputs on their way out, each with its stream's key. The engine thread's wait for the end
    of its step (`step_done`, an `Engine.on_step_end` hook); any other thread's go at once, behind
    them. `send` gets each batch in order, under `lock` (shared with anything else that must not
    interleave with it, such as the pipe's replies)."""

    def __init__(
        self, send: Callable[[Batch[K]], None], lock: threading.Lock | None = None
    ) -> None:
        self._send = send
        self._lock = lock if lock is not None else threading.Lock()
        self._pending: Batch[K] = []
        self.engine_thread: threading.Thread | None = None

    def sink(self, key: K) -> Callable[[RequestOutput], None]:
        def put(out: RequestOutput) -> None:
            with self._lock:
                self._pending.append((key, out))
            # Until the first step_done names the engine thread, every output goes at once.
            if threading.current_thread() is not self.engine_thread:
                self.flush()

        return put

    def step_done(self) -> None:
        """Called on the engine thread after each pass of its loop, which it thereby names."""
        self.engine_thread = threading.current_thread()
        self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            batch, self._pending = self._pending, []
            self._send(batch)
