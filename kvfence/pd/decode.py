"""DecodeService: the KV receiver. It connects to prefill workers, RESERVEs pre-allocated pages,
applies page writes after checking each against the room's grant, verifies DONE (I3) and commits,
and frees a room's pages only once prefill can no longer write them (I4).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client.core import Metric

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.admission import Admitted, Rejected
from kvfence.engine.engine import Engine
from kvfence.engine.request import GenerateRequest
from kvfence.engine.sequence import SeqMode, Sequence
from kvfence.engine.tp_group import TpBroken
from kvfence.faults import Faults
from kvfence.kv.pool import Grant
from kvfence.pd import glue, kvio, wire
from kvfence.pd import protocol as p
from kvfence.pd.ioloop import IOLoop
from kvfence.pd.pairing import model_fingerprint, node_info, pairing_problem
from kvfence.pd.pool_port import PoolPort, PortRuleBroken
from kvfence.pd.stats import TransferStats
from kvfence.pd.tls import TlsConfig
from kvfence.pd.transport.link import page_receiver
from kvfence.pd.transport.tcp import (
    Connection,
    LinkLimits,
    PeerKey,
    Placement,
    RecordError,
    resolve,
)
from kvfence.role import EngineRole
from kvfence.tp_layout import pd_tp_problem

log = logging.getLogger("kvfence.pd.decode")

# Runs of one connection being checked and written off the loop while the next ones arrive.
_RUNS_IN_FLIGHT = 2


# What a client sees when its prefill cannot be used: never the resolver's or the socket's words.
UNAVAILABLE = "prefill unavailable"


class _Unpaired(ConnectionError):
    """The prefill and this decode disagree on a pairing fact (I7)."""


@dataclass
class _Room:
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
class _Peer:
    conn: Connection | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    rooms: set[str] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)  # when its last room ended


class DecodeService(EngineRole):
    def __init__(
        self,
        cfg: EngineConfig,
        timeout_s: float = 30.0,
        backend: str = "tcp",
        tls: TlsConfig | None = None,
        faults: Faults | None = None,
        host: str = "127.0.0.1",
        limits: LinkLimits | None = None,
    ) -> None:
        """host: where this worker is reachable (a Mooncake peer's one-sided writes go there)."""
        self.faults = faults if faults is not None else Faults()
        if tls is None or tls.role != "decode":
            raise ValueError("a decode worker needs its decode TLS certificate (I8)")
        problem = pd_tp_problem(cfg.tp_size, backend)
        if problem is not None:
            raise ConfigError(problem)
        super().__init__(Engine(cfg, self.faults, hooks=self))
        self.pool_port = PoolPort(self.engine, self.faults)  # this service's only way into the pool
        self.slices = self.pool_port.slices  # None: one rank holds whole pages
        self.ranks = cfg.tp_size  # a run's payload carries every rank's slice
        self.tls = tls  # I8: every connection is mutual TLS with prefill certificates
        self.limits = limits or LinkLimits()
        # One-sided writes land anywhere in the registered pool: no grant to check them by (I3
        # and I4 carry those); the tcp receiver writes only through the port.
        self.link = page_receiver(backend, self.pool_port.view, host)
        fingerprint = model_fingerprint(cfg.model)
        info = node_info(self.engine, self.pool_port.view, "decode", fingerprint, backend)
        if cfg.unsafe_skip_preflight:
            info["unsafe_skip_capacity"] = True
        self.pairing = info  # the I7 facts; HELLO adds what the transport needs
        self.timeout_s = timeout_s
        self.rooms: dict[str, _Room] = {}
        self.peers: dict[PeerKey, _Peer] = {}  # one connection per resolved prefill address
        self.transfer_stats = TransferStats("decode")
        self.pairing_errors: dict[str, str] = {}
        self.io = IOLoop("kvfence-decode-io")
        self.loop = self.io.loop

    # ---- the role the HTTP layer talks to ------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Any) -> Admitted | Rejected:
        """The decode door: admission, then the engine reserves pages and calls on_reserved."""
        if not req.peer:
            return Rejected(
                req.request_id,
                "pd_route_required",
                "This is a decode worker: send requests through the kvfence router.",
            )
        return self.engine.submit(req, sink, SeqMode.DECODE_ONLY)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.start()
        self.io.on_stop(self._close_all)
        self.io.start(self._begin())

    def shutdown(self) -> None:
        self.io.stop()
        self.link.close()
        self.engine.shutdown()

    async def _begin(self) -> None:
        asyncio.ensure_future(self._expire())

    def _close_all(self) -> None:
        for peer in list(self.peers.values()):
            if peer.conn is not None:
                peer.conn.close()

    def metrics(self) -> Iterable[Metric]:
        return self.transfer_stats.metrics(self.engine.stats().pages_handoff)

    def info(self) -> dict[str, Any]:
        return {
            "role": "decode",
            "bootstrap_host": None,
            "bootstrap_port": None,
            "model": self.engine.model_name,
            "context_length": self.engine.context_length,
            "page_size": self.pool_port.view.page_size,
            "pairing_errors": dict(self.pairing_errors),
            "counters": self.transfer_stats.snapshot(),
            "transfer_marks": self.transfer_stats.marks(),
            "pairing": dict(self.pairing),
        }

    # ---- engine hooks (engine thread) -----------------------------------------------------------

    def on_reserved(self, seq: Sequence) -> None:
        req = seq.admitted.request
        assert seq.grant is not None and req.peer is not None
        self.pool_port.hand_over(seq.grant)  # parked in HANDOFF: the pages are the IO loop's now
        cached = seq.num_sealed  # the scheduler's hit: cache pages the sequence references
        reserve = p.Reserve(
            room=seq.request_id,
            tenant=req.tenant,
            prompt=req.prompt_token_ids,
            sampling=req.sampling.to_dict(),
            max_tokens=seq.admitted.max_tokens,
            dst_pages=tuple(seq.pages[cached:]),
            grant=seq.grant.grant_id,
            cache_salt=req.cache_salt or "",
            cached_tokens=cached * self.pool_port.view.page_size,
            prefix_digest=self._held_digest(seq.pages[:cached]) if cached else "",
        )
        self.loop.call_soon_threadsafe(
            self._reserve, reserve, req.peer, seq.grant, list(seq.pages), cached
        )

    def _held_digest(self, pages: list[int]) -> str:
        """What these cache pages hold, as the cache recorded it when they were sealed (engine
        thread: the cache's bookkeeping is the engine's)."""
        return self.pool_port.held_digest(pages, self.faults.guards().on("prefix_namespace"))

    def on_prefilled(self, seq: Sequence) -> None:  # pragma: no cover - prefill only
        raise AssertionError("a decode engine never prefills for a transfer")

    def on_abort(self, seq: Sequence) -> None:
        self.loop.call_soon_threadsafe(self._feed, seq.request_id, p.ClientAborted())

    # ---- rooms ----------------------------------------------------------------------------------

    def _reserve(
        self, r: p.Reserve, peer_addr: str, grant: Grant, pages: list[int], cached: int
    ) -> None:
        self.transfer_stats.inc("reserved")
        view = self.pool_port.view
        room = p.DecodeRoom(
            r.room, len(r.prompt), len(pages), cached_pages=cached, cached_tokens=r.cached_tokens
        )
        # The cached prefix as it is now: the read-back at DONE must find it unchanged.
        try:
            sums = self._pool_sums(grant, pages[:cached], r.cached_tokens) if cached else []
        except TpBroken:
            sums = []  # the engine failed closed: this room's client has its error already
        self.rooms[r.room] = _Room(
            room,
            None,
            pages,
            grant,
            time.monotonic() + self.timeout_s,
            time.monotonic(),
            cached,
            sums,
        )
        self.transfer_stats.inc("prompt_tokens", len(r.prompt))
        self.transfer_stats.inc("prefix_cached_tokens", r.cached_tokens)
        self.transfer_stats.inc(
            "bytes_not_transferred", cached * self.ranks * kvio.payload_size(view, view.page_size)
        )
        if cached and self.faults.active("stale_cached_page"):
            kvio.corrupt_page(self.pool_port.pages(grant), pages[0])
        asyncio.ensure_future(self._send_reserve(r, peer_addr))

    async def _send_reserve(self, r: p.Reserve, peer_addr: str) -> None:
        try:
            key = await asyncio.wait_for(resolve(peer_addr), self.timeout_s)
        except (TimeoutError, OSError, ValueError) as e:
            log.error("cannot resolve prefill %r: %s", peer_addr, e)
            self._feed(r.room, p.ConnectionLost(), reason=UNAVAILABLE)
            return
        peer = await self._peer(key)
        room = self.rooms.get(r.room)
        if peer.conn is None or peer.conn.closed or room is None:
            # Never connected (or the room ended meanwhile): nothing was sent, no prefill can
            # write these pages, so they may go at once.
            self._feed(r.room, p.ConnectionLost(), reason=peer.error)
            return
        # Only now, TLS and HELLO done in this connection, does anything of the request leave.
        room.peer = key
        peer.rooms.add(r.room)
        try:
            await peer.conn.send(r)
        except ConnectionError:
            pass  # the reader task feeds ConnectionLost for every room of this peer
        if self.faults.active("client_disconnect"):
            # The client hangs up mid-transfer: by then prefill is computing or sending.
            asyncio.get_running_loop().call_later(0.5, self.engine.abort, r.room)

    async def _peer(self, key: PeerKey) -> _Peer:
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = _Peer()
            asyncio.ensure_future(self._connect(key, peer))
        await peer.ready.wait()
        return peer

    async def _connect(self, key: PeerKey, peer: _Peer) -> None:
        addr = f"{key[0]}:{key[1]}"
        conn: Connection | None = None
        try:
            # TLS first: the peer proves a prefill certificate of the cluster CA in this very
            # connection before the pairing facts, let alone a request, are sent (I8).
            conn = await Connection.open(*key, self.timeout_s, self.tls, self.faults)
            await conn.send(wire.Hello({**self.pairing, **self.link.hello_info()}))
            msg, _ = await asyncio.wait_for(conn.recv(), self.timeout_s)
            if isinstance(msg, wire.HelloRefused):
                self.transfer_stats.inc("pairing_refused")
                self.pairing_errors[addr] = msg.reason
                raise _Unpaired(f"prefill refused to pair: {msg.reason}")
            if not isinstance(msg, wire.HelloOk):
                raise wire.WireError("expected HelloOk")
            problem = pairing_problem(self.pairing, msg.info, self.faults.guards())
            if problem is not None:
                self.transfer_stats.inc("pairing_refused")
                self.pairing_errors[addr] = problem
                raise _Unpaired(f"refusing to pair with the prefill: {problem}")
            self.pairing_errors.pop(addr, None)
            peer.conn = conn
        except (TimeoutError, OSError, ConnectionError, ValueError) as e:
            log.error("cannot use prefill %s: %s", addr, e)
            if conn is not None:
                conn.close()
            # A pairing mismatch (I7) is configuration the client may see; a failed dial says
            # nothing more: the resolver's and the socket's words are the operator's (log).
            peer.error = f"{UNAVAILABLE}: {e}" if isinstance(e, _Unpaired) else UNAVAILABLE
            self.peers.pop(key, None)  # the next request tries again
            peer.ready.set()
            return
        peer.idle_since = time.monotonic()
        peer.ready.set()
        await self._read(key, peer)

    async def _read(self, addr: PeerKey, peer: _Peer) -> None:
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
                self._on_message(msg, payload)
        except (ConnectionError, wire.WireError) as e:
            if isinstance(e, (wire.WireError, RecordError)):
                self.transfer_stats.inc("bad_frames")
            log.warning("connection to prefill %s ended: %s", addr, e)
        except PortRuleBroken as e:
            # A bug of this service: every room of the connection fails closed with it.
            self.transfer_stats.inc("port_rule_broken")
            log.error("connection to prefill %s dropped: %s", addr, e)
        finally:
            conn.close()
            # A write already handed over still lands: wait for it before releasing anything.
            if writing:
                await asyncio.gather(*writing, return_exceptions=True)
            if self.peers.get(addr) is peer:
                del self.peers[addr]
            # The reader has stopped: nothing more of this connection can reach the pool.
            for rid in list(peer.rooms):
                self._feed(rid, p.ConnectionLost())

    def _on_message(self, msg: wire.Frame, payload: memoryview) -> None:
        if isinstance(msg, p.Done):
            self._on_done(msg)
        elif isinstance(msg, p.Abort):
            self._feed(msg.room, p.AbortArrived(msg))
        elif isinstance(msg, p.AbortAck):
            self._feed(msg.room, p.AbortAckArrived())
        elif isinstance(msg, wire.Heartbeat):
            pass
        else:
            raise wire.WireError(f"unexpected {type(msg).__name__} from prefill")

    def _run_pages(self, room: _Room | None, run: wire.PageRun, nbytes: int) -> list[int] | None:
        """The pages a run of a RESERVED room writes, if its position and size are right."""
        if room is None or room.state.state is not p.DState.RESERVED:
            return None
        view = self.pool_port.view
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
        owned = self.pool_port.check_destination(grant, pages)
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
        views = self.link.place(self.pool_port.pages(room.grant), pages, msg.n_tokens)
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
            self.transfer_stats.inc("late_writes_dropped", len(run.checksums))
            return None
        self.transfer_stats.mark(run.room, "first_page")
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
        view = self.pool_port.view
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
        if self.slices is not None and self.faults.active("tp_rank_skips_tag_check"):
            owned = [True] * n  # rank 0's own check off: the other ranks' must still refuse
        foreign = owned.count(False)
        if foreign:
            intact = [i and o for i, o in zip(intact, owned, strict=True)]
        good = [i for i, ok in enumerate(intact) if ok]
        if data is None or not good:
            return intact, foreign, 0
        which = None if len(good) == n else good
        dst = [pages[i] for i in good]
        self.pool_port.write(grant, dst, run.n_tokens, data[0], which)
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
                    self.faults.active("tp_corrupt_rank_slice"),
                    self.faults.active("tp_leader_decides_alone"),
                )
            except TpBroken:  # the engine failed closed; the room fails with it
                return [False] * n, foreign, 0
            for i, bad in zip(good, refused, strict=True):
                if bad:
                    intact[i] = False
                    foreign += 1
        return intact, foreign, len(good)

    def _placed_run(
        self, run: wire.PageRun, room: _Room, hashes: kvio.PageHashes | None
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
            self.pool_port.mark_written(room.grant, good)
        self._run_applied(run, intact, owned.count(False), len(good))

    def _run_applied(
        self, run: wire.PageRun, intact: list[bool], foreign: int, written: int
    ) -> None:
        view = self.pool_port.view
        if foreign:
            self.transfer_stats.inc("grant_mismatches", foreign)
        if written:
            self.transfer_stats.inc("pages_received", written)
            self.transfer_stats.inc(
                "bytes_received", written * self.ranks * kvio.payload_size(view, run.n_tokens)
            )
        bad = intact.count(False)
        if bad:
            self.transfer_stats.inc("checksum_mismatches", bad)
        self._feed(
            run.room,
            p.RunArrived(
                tuple(
                    p.PageArrived(run.first + i, run.n_tokens, c, ok)
                    for i, (c, ok) in enumerate(zip(run.checksums, intact, strict=True))
                )
            ),
        )
        if run.first == 0 and self.faults.active("kill_decode"):
            self.faults.crash("kill_decode")

    def _on_done(self, done: p.Done) -> None:
        room = self.rooms.get(done.room)
        ok = False
        if room is not None and room.state.state is p.DState.RESERVED:
            self.transfer_stats.mark(done.room, "done_arrived")
            ok = self._pool_matches(room, done)
            self.transfer_stats.mark(done.room, "read_back")
        self._feed(done.room, p.DoneArrived(done, ok))
        if room is not None:
            marks = self.transfer_stats
            end = marks.mark(done.room, "done_handled")
            first = marks.mark(done.room, "first_page", end)
            marks.observe_phase("receive", end - first)

    def _pool_matches(self, room: _Room, done: p.Done) -> bool:
        """Read every page decode will attend to back from the pool and hash it: the sent ones
        must be exactly what prefill computed, whatever wrote them (late, foreign or one-sided
        writes), and the cached prefix exactly what it held when RESERVE went out."""
        if done.n_tokens != room.state.n_tokens or done.n_pages != len(room.pages):
            return False
        try:
            sums = self._pool_sums(room.grant, room.pages, done.n_tokens)
        except TpBroken:
            return False  # a rank's slice cannot be read back: nothing to commit
        k = room.cached
        if sums[:k] != room.prefix_sums:
            return False
        return p.digest_of(tuple(enumerate(sums[k:])), done.n_tokens) == done.digest

    def _pool_sums(self, grant: Grant, pages: list[int], n_tokens: int) -> list[int]:
        """Per-page checksums of what the pool holds, over every rank's slice (I3)."""
        return self.pool_port.checksums(grant, pages, n_tokens)

    def _feed(self, rid: str, event: Any, reason: str | None = None) -> None:
        """reason: why the connection was lost, for the client's error message."""
        room = self.rooms.get(rid)
        fx = _RoomEffects(self, rid, room, reason)
        state = glue.decode_feed(
            rid, None if room is None else room.state, event, self.faults.guards(), fx
        )
        if room is None or state is None:
            return
        room.state = state
        if glue.decode_ended(state):
            del self.rooms[rid]
            peer = self.peers.get(room.peer) if room.peer is not None else None
            if peer is not None:
                peer.rooms.discard(rid)
                if not peer.rooms:
                    peer.idle_since = time.monotonic()

    def _send(self, rid: str, peer_addr: PeerKey | None, msg: p.Message) -> None:
        peer = self.peers.get(peer_addr) if peer_addr else None
        if peer is None or peer.conn is None:
            return
        if isinstance(msg, p.Abort):
            self.transfer_stats.inc("aborts_sent")
        conn = peer.conn

        async def go() -> None:
            try:
                await conn.send(msg)
            except ConnectionError:
                pass

        asyncio.ensure_future(go())

    def _committed(self, rid: str, room: _Room, first_token: int, first_logprobs: dict) -> None:
        self.link.committed(self.pool_port, room.grant, room.reserved)
        self.transfer_stats.inc("transfers_committed")
        self.transfer_stats.observe_latency(time.monotonic() - room.started)
        self.pool_port.commit(rid, room.grant, first_token, first_logprobs)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            self._close_idle(now)
            for rid, room in list(self.rooms.items()):
                if now <= room.deadline:
                    continue
                if room.state.state is p.DState.RESERVED:
                    room.deadline = now + self.timeout_s
                    self._feed(rid, p.TimedOut())
                elif room.state.state is p.DState.ABORTING:
                    # No ack within a second timeout: fence by closing the connection; its
                    # reader then stops and every room on it is released safely.
                    peer = self.peers.get(room.peer) if room.peer is not None else None
                    if peer is not None and peer.conn is not None:
                        log.error(
                            "no ABORT_ACK for room %s: closing connection to %s", rid, room.peer
                        )
                        peer.conn.close()
                    room.deadline = now + self.timeout_s

    def _close_idle(self, now: float) -> None:
        """Close prefill connections that carried no room for the idle timeout: each holds fds
        and buffers on both sides. Its reader then ends and forgets it; a later request dials
        afresh."""
        for key, peer in list(self.peers.items()):
            idle = now - peer.idle_since > self.limits.idle_timeout_s
            if peer.conn is not None and not peer.rooms and idle:
                log.info("closing idle connection to prefill %s:%s", *key)
                self.transfer_stats.inc("idle_closed")
                peer.conn.close()


@dataclass
class _Placed(Placement):
    """A PageRun decrypted into the pool, with its pages' checksums taken as it landed."""

    hashes: kvio.PageHashes | None = None


class _RoomEffects:
    """What decode's glue actions do to one room (glue.DecodeEffects), on the io loop."""

    def __init__(
        self, svc: DecodeService, rid: str, room: _Room | None, reason: str | None
    ) -> None:
        self.svc, self.rid, self.room, self.reason = svc, rid, room, reason

    def send(self, message: p.Message) -> None:
        # A room decode forgot has no route back: its peer is unknown, the message goes nowhere.
        self.svc._send(self.rid, None if self.room is None else self.room.peer, message)

    def commit(self, first_token: int, first_logprobs: dict) -> None:
        assert self.room is not None
        self.svc._committed(self.rid, self.room, first_token, first_logprobs)

    def fail_client(self, code: str, message: str, status: int) -> None:
        self.svc.transfer_stats.inc(f"transfers_failed_{code}")
        if self.reason is not None:
            message = self.reason  # why this request could not be served, without detail
        self.svc.engine.fail(self.rid, message, code, status)

    def release(self) -> None:
        self.svc.pool_port.release(self.rid, None if self.room is None else self.room.grant)
