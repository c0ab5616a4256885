"""Decode's receiving side, on the IO loop with one writer thread: a prefill connection's
reader (`RunReceiver.read`) and what each PageRun does to its room's pages. Every page is checked
(position, size, checksum, the room's grant: I2, I3) on its own and only the good ones are written,
through the pool port; the room table sees the run as one RunArrived. Other frames of the
connection (DONE, ABORT, ABORT_ACK) go to the room table only after every earlier write of it
has landed: the protocol's ordering.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfence.engine.tp_group import TpBroken
from kvfence.faults import Faults
from kvfence.kv.pool import Grant
from kvfence.pd import kvio, wire
from kvfence.pd import protocol as p
from kvfence.pd.peers import Peer
from kvfence.pd.pool_port import PoolPort, PortRuleBroken
from kvfence.pd.stats import TransferStats
from kvfence.pd.transport.page_link import PageReceiver
from kvfence.pd.transport.tcp import Connection, PeerKey, Placement, RecordError

log = logging.getLogger("kvfence.pd.decode")

# Runs of one connection being checked and written off the loop while the next ones arrive.
_RUNS_IN_FLIGHT = 2


@dataclass
class Room:
    """What decode's room table keeps of a room beside its protocol state."""

    state: p.DecodeRoom
    peer: PeerKey | None  # the resolved prefill address, once resolved
    pages: list[int]  # every page of the prompt: the cached prefix's, then the reserved ones
    grant: Grant
    deadline: float
    started: float
    cached: int = 0  # leading pages from decode's prefix cache (referenced, never written)
    prefix_sums: list[int] = field(default_factory=list)  # theirs when RESERVE went out

    @property
    def reserved(self) -> list[int]:
        """The pages prefill writes (PageRun.first counts from the first of them)."""
        return self.pages[self.cached :]


@dataclass
class _Placed(Placement):
    """A PageRun decrypted into the pool, with its pages' checksums taken as it landed."""

    hashes: kvio.PageHashes | None = None


class RunReceiver:
    """rooms: the room table's (read here, changed there); feed(rid, event): an event for the
    room table; on_message(frame): any other frame of a connection, in order."""

    def __init__(
        self,
        rooms: dict[str, Room],
        port: PoolPort,
        link: PageReceiver,
        faults: Faults,
        stats: TransferStats,
        ranks: int,
        feed: Callable[[str, Any], None],
        on_message: Callable[[wire.Frame], None],
    ) -> None:
        self.rooms, self.port, self.link, self.faults, self.stats = rooms, port, link, faults, stats
        self.ranks = ranks  # a run's payload carries every rank's slice
        self.slices = port.slices
        self.feed, self.on_message = feed, on_message

    async def read(self, addr: PeerKey, peer: Peer) -> None:
        assert peer.conn is not None
        conn = peer.conn
        writing: deque[asyncio.Future] = deque()  # runs handed to the writer, in arrival order
        placed: list[_Placed] = []  # where recv() decrypted the frame it returned, if it did

        def place(msg: wire.Frame, nbytes: int) -> _Placed | None:
            found = self._place(msg, nbytes)
            if found is not None:
                placed.append(found)
            return found

        try:
            while True:
                placed.clear()  # recv() asks place() only for a frame with a payload
                msg, payload = await conn.recv(place)
                if isinstance(msg, wire.PageRun):
                    applied = self._on_run(conn, msg, payload, placed[0] if placed else None)
                    if applied is not None:
                        writing.append(applied)
                    while writing and (writing[0].done() or len(writing) > _RUNS_IN_FLIGHT):
                        await writing.popleft()
                    continue
                # Anything else of this connection (DONE, ABORT, ABORT_ACK: fences) is handled
                # only after every earlier write of it has landed: the protocol's ordering.
                while writing:
                    await writing.popleft()
                self.on_message(msg)
        except (ConnectionError, wire.WireError) as e:
            if isinstance(e, (wire.WireError, RecordError)):
                self.stats.inc("bad_frames")
            log.warning("connection to prefill %s ended: %s", addr, e)
        except PortRuleBroken as e:
            # A bug of this service: every room of the connection fails closed with it.
            self.stats.inc("port_rule_broken")
            log.error("connection to prefill %s dropped: %s", addr, e)
        finally:
            conn.close()
            # A write already handed over still lands: wait for it before releasing anything.
            if writing:
                await asyncio.gather(*writing, return_exceptions=True)
            # The reader stops here; the dialer then fails the rooms still on the connection.

    def _run_pages(self, room: Room | None, run: wire.PageRun, nbytes: int) -> list[int] | None:
        """The pages a run of a RESERVED room writes, if its position and size are right."""
        if room is None or room.state.state is not p.DState.RESERVED:
            return None
        view = self.port.view
        n = len(run.checksums)
        reserved = room.reserved
        ok_shape = (
            0 <= run.first
            and run.first + n <= len(reserved)
            and 0 < run.n_tokens <= view.page_size
            and nbytes == self.ranks * self.link.payload_bytes(view, n, run.n_tokens)
        )
        return reserved[run.first : run.first + n] if ok_shape else None

    def _owned(self, grant: Grant, pages: list[int]) -> list[bool]:
        """I2 on the write path: per page, whether it still belongs to the room's grant and
        tenant (every page, with the guard off: the mutation twin)."""
        owned = self.port.check_destination(grant, pages)
        return owned if self.faults.guards().on("dest_check") else [True] * len(pages)

    def _place(self, msg: wire.Frame, nbytes: int) -> _Placed | None:
        """Where a PageRun's bytes are decrypted to, asked with its header: straight into the
        room's pages when the transport allows it and every destination page is the room's
        (I2, checked before a byte lands; a run with a foreign page goes the buffered way,
        which writes only the room's own pages). The writes stop the moment the room stops
        being RESERVED. Each page's checksum is taken from the pool as its blocks land, and
        compared once the run is in (_placed_run)."""
        if not isinstance(msg, wire.PageRun) or self.slices is not None:
            return None  # under tensor parallelism a run carries every rank's slice: buffered
        room = self.rooms.get(msg.room)
        pages = self._run_pages(room, msg, nbytes)
        if room is None or pages is None or not all(self._owned(room.grant, pages)):
            return None
        views = self.link.place(self.port.pages(room.grant), pages, msg.n_tokens)
        if views is None:
            return None
        hashes = kvio.PageHashes(len(pages)) if self.faults.guards().on("checksum") else None
        rid = msg.room

        def holds() -> bool:  # the room still holds its pages and takes writes
            return self.rooms.get(rid) is room and room.state.state is p.DState.RESERVED

        landed = None if hashes is None else hashes.feeds(len(views))
        return _Placed(views, holds, landed, hashes=hashes)

    def _on_run(
        self,
        conn: Connection,
        run: wire.PageRun,
        payload: memoryview,
        placed: _Placed | None = None,
    ) -> asyncio.Future | None:
        """A run of pages: every page is checked (position, size, checksum, grant) on its own,
        the good ones are written in one batch (or were decrypted into place: _place), and the
        state machine sees the run as one RunArrived. The transport applies a buffered run: at
        once, or on its writer thread (the Future)."""
        room = self.rooms.get(run.room)
        if room is None or room.state.state is not p.DState.RESERVED:
            # the tcp receiver can refuse a late write (a placed run stopped writing then)
            self.stats.inc("late_writes_dropped", len(run.checksums))
            return None
        self.stats.mark(run.room, "first_page")
        if placed is not None:
            self._placed_run(run, room, placed.hashes)
            return None
        pages = self._run_pages(room, run, payload.nbytes)
        if pages is None:
            self._run_applied(run, [False] * len(run.checksums), 0, 0)
            return None
        check = self.faults.guards().on("checksum")  # off: mutation twin, the bytes as they come
        return self.link.apply(
            conn,
            payload,
            lambda data: self._write_run(run, pages, room.grant, data, check),
            lambda result: self._run_applied(run, *result),
        )

    def _write_run(
        self,
        run: wire.PageRun,
        pages: list[int],
        grant: Grant,
        payload: memoryview | None,
        check: bool,
    ) -> tuple[list[bool], int, int]:
        """(intact per page, pages failing the grant check, pages written): the writer thread's
        part of a run, or the loop's for one-sided runs (payload None: nothing to write)."""
        view = self.port.view
        n = len(pages)
        intact = [True] * n
        data = None
        if payload is not None:
            size = run.n_tokens * kvio.token_bytes(view)
            shape = (self.ranks, 2, view.num_layers, n, size)
            data = torch.frombuffer(payload, dtype=torch.uint8).view(shape)
            if check:
                got = kvio.run_checksums(data)
                intact = [g == c for g, c in zip(got, run.checksums, strict=True)]
        owned = self._owned(grant, pages)
        if self.slices is not None:  # rank 0 skipping its own check: the others' must refuse
            owned = self.faults.hook("tp_rank_skips_tag_check", owned)
        foreign = owned.count(False)
        if foreign:
            intact = [i and o for i, o in zip(intact, owned, strict=True)]
        good = [i for i, ok in enumerate(intact) if ok]
        if data is None or not good:
            return intact, foreign, 0
        which = None if len(good) == n else good
        dst = [pages[i] for i in good]
        self.port.write(grant, dst, run.n_tokens, data[0], which)
        if self.slices is not None:
            # The other ranks' slices: each rank writes only pages the grant owns in its own
            # tables; a page any rank refused fails the room like a foreign one here.
            try:
                refused = self.slices.scatter(
                    data[1:, :, :, good],
                    dst,
                    run.n_tokens,
                    grant,
                    self.faults.guards().on("dest_check"),
                    self.faults.hook("tp_corrupt_rank_slice", False),
                    self.faults.hook("tp_leader_decides_alone", False),
                )
            except TpBroken:  # the engine failed closed; the room fails with it
                return [False] * n, foreign, 0
            for i, bad in zip(good, refused, strict=True):
                if bad:
                    intact[i] = False
                    foreign += 1
        return intact, foreign, len(good)

    def _placed_run(
        self, run: wire.PageRun, room: Room, hashes: kvio.PageHashes | None
    ) -> None:
        """A run decrypted straight into the room's pages: each page is intact if its bytes in
        the pool hashed to the sender's checksum as they landed and it is still the room's;
        only those count as written. hashes None: the checksum guard is off (mutation twin,
        the bytes as they come)."""
        pages = room.reserved[run.first : run.first + len(run.checksums)]
        intact = [True] * len(pages)
        if hashes is not None:
            intact = [g == c for g, c in zip(hashes.digests(), run.checksums, strict=True)]
        owned = self._owned(room.grant, pages)
        intact = [i and o for i, o in zip(intact, owned, strict=True)]
        good = [page for page, ok in zip(pages, intact, strict=True) if ok]
        if good:
            self.port.mark_written(room.grant, good)
        self._run_applied(run, intact, owned.count(False), len(good))

    def _run_applied(
        self, run: wire.PageRun, intact: list[bool], foreign: int, written: int
    ) -> None:
        view = self.port.view
        if foreign:
            self.stats.inc("grant_mismatches", foreign)
        if written:
            self.stats.inc("pages_received", written)
            self.stats.inc(
                "bytes_received", written * self.ranks * kvio.payload_size(view, run.n_tokens)
            )
        bad = intact.count(False)
        if bad:
            self.stats.inc("checksum_mismatches", bad)
        self.feed(
            run.room,
            p.RunArrived(
                tuple(
                    p.PageArrived(run.first + i, run.n_tokens, c, ok)
                    for i, (c, ok) in enumerate(zip(run.checksums, intact, strict=True))
                )
            ),
        )
        if run.first == 0:  # the process dies right after applying a room's first pages
            self.faults.hook("kill_decode")

