"""The router's view of its workers: one pool per role, least-loaded picks with round-robin ties,
and the I7 pairing facts that keep a prefill and a decode apart."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from kvfence.pd.pairing import pairing_problem


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)  # identity, not field equality: in_flight changes all the time
class Worker:
    """One worker as the router sees it. Only the event loop touches it, so no locks."""

    url: str
    role: Role
    name: str
    healthy: bool = False
    in_flight: int = 0
    detail: str | None = "not checked yet"
    info: dict[str, Any] | None = None
    bootstrap: str | None = None  # "host:port" of a prefill's transfer bootstrap

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "role": self.role.value,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "bootstrap": self.bootstrap,
            "detail": self.detail,
        }


class WorkerPool:
    """The workers of one role; picks the least-loaded healthy one, ties in round robin."""

    def __init__(self, role: Role, urls: Sequence[str]) -> None:
        self.role = role
        self.workers = [Worker(u, role, f"{role.value}-{i}") for i, u in enumerate(urls)]
        self._rr = 0

    def usable(self, w: Worker) -> bool:
        # A prefill nobody can reach over the transfer protocol is no use to a decode.
        return w.healthy and (self.role is Role.DECODE or w.bootstrap is not None)

    def pick(self, exclude: Sequence[Worker] = (), partner: Worker | None = None) -> Worker | None:
        return self.least_loaded(self.candidates(exclude, partner))

    def candidates(
        self, exclude: Sequence[Worker] = (), partner: Worker | None = None
    ) -> list[Worker]:
        """The workers a request may go to: usable, not excluded, and able to pair (I7)."""
        return [
            w
            for w in self.workers
            if self.usable(w) and w not in exclude and pairing_error(w, partner) is None
        ]

    def least_loaded(self, candidates: Sequence[Worker]) -> Worker | None:
        if not candidates:
            return None
        least = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == least]
        chosen = tied[self._rr % len(tied)]
        self._rr += 1
        return chosen

    def healthy_count(self) -> int:
        return sum(1 for w in self.workers if self.usable(w))


def pairing_error(a: Worker, b: Worker | None) -> str | None:
    """Why a prefill and a decode must not pair (I7), from the facts each reports in /pd/info."""
    if b is None or a.info is None or b.info is None:
        return None
    fa, fb = a.info.get("pairing"), b.info.get("pairing")
    if not isinstance(fa, dict) or not isinstance(fb, dict):
        return None  # a worker that reports no pairing facts pairs at the transfer handshake
    return pairing_problem(fa, fb)


def normalize_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"worker URL {url!r} must look like http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} must not have a path, query or fragment")
    return f"{parts.scheme}://{parts.netloc}"
