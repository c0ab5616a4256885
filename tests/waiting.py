"""The suite's one bounded wait: poll a condition until it holds or a deadline passes.

Tests synchronise on observable state, never on sleeps; the only sleep is the poll interval
between two looks. A wait that runs out fails with what was awaited, so a loaded machine shows
as a clear message instead of a hang or a bare assert.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Message = str | Callable[[], str]


def poll(pred: Callable[[], object], timeout: float, interval: float = 0.01) -> bool:
    """True as soon as `pred()` is truthy, False once `timeout` seconds have passed without it.
    The condition is looked at once more at the deadline, so a slow last step still counts."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return bool(pred())
        time.sleep(interval)


def wait_for(
    pred: Callable[[], object],
    timeout: float = 5.0,
    message: Message = "condition not met",
    interval: float = 0.01,
) -> None:
    """Waits until `pred()` is truthy; AssertionError naming `message` (a string, or a callable
    evaluated only on failure, e.g. to read a log) when `timeout` seconds pass first."""
    if not poll(pred, timeout, interval):
        detail = message() if callable(message) else message
        raise AssertionError(f"{detail} (waited {timeout:g} s)")
