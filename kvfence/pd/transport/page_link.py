"""The interface every transport implements (`PageSender`, `PageReceiver`) and the room a sender
is handed (`RoomSend`). The links (tcp_link.py, mooncake_link.py) depend on this module alone;
link.py picks one per backend."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from kvfence.kv.pool import Grant
from kvfence.pd import kvio
from kvfence.pd.kvio import PageTensors
from kvfence.pd.transport.tcp import Connection

if TYPE_CHECKING:
    from kvfence.pd.pool_port import PoolPort
    from kvfence.pd.tp_slices import RankSlices

R = TypeVar("R")


@dataclass
class RoomSend:
    """One room's pages to send, and the sender's hooks into the room's state."""

    room: str
    conn: Connection
    view: PageTensors  # the pool port's tensors, handed out for this room's grant
    src: list[int]  # the room's pages in prefill's pool
    dst: list[int]  # the pages decode reserved for it
    runs: list[tuple[int, int, int]]  # (first page, pages, tokens per page), kvio.runs
    n_tokens: int
    corrupt: bool  # fault injection: flip a byte of the first page after checksumming it
    cancelled: Callable[[], bool]  # the room was told to stop sending
    stopped: Callable[[], bool]  # send no further frame (cancelled, unless a fault says not)
    hold: Callable[[asyncio.Future], None]  # the room's pages are read until this is done
    sent: Callable[[int, int], None]  # after each PageRun frame: (pages, tokens per page)
    slices: RankSlices | None = None  # tensor parallelism: every rank's slice goes in each run


class PageSender(ABC):
    """Prefill's side of the transport."""

    backend: str
    run_bytes: int = kvio.RUN_BYTES  # payload bytes per PageRun frame (kvio.runs)

    @abstractmethod
    def peer_joined(self, conn: Connection, info: dict[str, Any]) -> None:
        """A decode worker's HELLO was accepted: learn what the transport needs of it."""

    @abstractmethod
    def peer_left(self, conn: Connection) -> None:
        """The connection closed: forget what peer_joined learned."""

    @abstractmethod
    async def send_room(self, job: RoomSend) -> list[tuple[int, int]] | None:
        """Send every run of the room as PageRun frames on job.conn (and the bytes however this
        transport moves them); the (page index, checksum) of each page sent, or None when the
        room stopped first. ConnectionError: the connection went; anything else: the transfer
        failed and the room must be aborted."""

    @abstractmethod
    def close(self) -> None:
        """The service is shutting down: release threads and registered memory."""


class PageReceiver(ABC):
    """Decode's side of the transport."""

    backend: str

    @abstractmethod
    def hello_info(self) -> dict[str, Any]:
        """What prefill must know of this worker beyond the pairing facts."""

    @abstractmethod
    def payload_bytes(self, pool: PageTensors, n_pages: int, n_tokens: int) -> int:
        """The payload a PageRun of n_pages pages of n_tokens tokens must carry."""

    def place(self, pool: PageTensors, pages: list[int], n_tokens: int) -> list[memoryview] | None:
        """Views of `pages` (their first n_tokens tokens) in run layout for a PageRun's payload
        to be decrypted straight into, or None: the payload comes in a buffer to apply()."""
        return None

    @abstractmethod
    def apply(
        self,
        conn: Connection,
        payload: memoryview,
        write: Callable[[memoryview | None], R],
        applied: Callable[[R], None],
    ) -> asyncio.Future | None:
        """Check and write one run: write(payload or None when the bytes are already in the
        pool), then applied(its result) on the loop. A Future while that is still under way
        (the caller awaits it before any later control frame of the connection is handled)."""

    @abstractmethod
    def committed(self, port: PoolPort, grant: Grant, pages: list[int]) -> None:
        """A room's transfer was verified; the port is about to hand its pages back."""

    @abstractmethod
    def close(self) -> None:
        """The service is shutting down: release threads and registered memory."""
