"""IOLoop: an asyncio loop in its own thread, with an orderly stop (close sockets, cancel tasks,
join) so no coroutine outlives its loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any


class IOLoop:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._on_stop: list[Callable[[], Any]] = []

    def start(self, setup: Coroutine[Any, Any, Any] | None = None) -> None:
        self._thread.start()
        if setup is not None:
            asyncio.run_coroutine_threadsafe(setup, self.loop).result(timeout=30)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the loop thread (from any thread)."""
        self.loop.call_soon_threadsafe(fn, *args)

    def on_stop(self, fn: Callable[[], Any]) -> None:
        self._on_stop.append(fn)

    def stop(self, timeout: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        self._thread.join(timeout)

    async def _shutdown(self) -> None:
        for fn in self._on_stop:
            fn()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.loop.stop()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
