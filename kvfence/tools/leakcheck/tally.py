"""Counts per probe (requests, served, refused, leaks, wrong statuses, errors, own canaries
echoed) and the progress line on stderr."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO


@dataclass
class ProbeTally:
    requests: int = 0
    served: int = 0  # 2xx
    refused: int = 0  # 4xx
    leaks: int = 0  # requests whose output held another request's canary
    wrong_statuses: int = 0
    errors: int = 0
    echoed_own: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def __add__(self, other: ProbeTally) -> ProbeTally:
        return ProbeTally(**{k: v + getattr(other, k) for k, v in self.__dict__.items()})


class Progress:
    """A one-line bar on a terminal; a line per 10% elsewhere (CI logs)."""

    def __init__(self, total: int, stream: IO[str], enabled: bool) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.start = time.monotonic()
        self._last_decile = -1

    def update(self, done: int, leaks: int, wrong: int, errors: int) -> None:
        if not self.enabled:
            return
        frac = min(done / self.total, 1.0)
        line = (
            f"leakcheck {done}/{self.total} requests, leaks {leaks}, wrong status {wrong}, "
            f"errors {errors}, {time.monotonic() - self.start:.0f} s"
        )
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {line}")
            self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
