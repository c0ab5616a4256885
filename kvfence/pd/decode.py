"""DecodeService: the KV receiver. It connects to prefill workers, RESERVEs pre-allocated pages,
applies page writes after checking each against the room's grant, verifies DONE (I3) and commits,
and frees a room's pages only once prefill can no longer write them (I4).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfence import faults
from kvfence.engine.admission import Admitted, Rejected
from kvfence.engine.engine import Engine
from kvfence.engine.request import GenerateRequest
from kvfence.engine.sequence import SeqMode, Sequence
from kvfence.kv.pool import Grant
from kvfence.pd import auth, kvio, wire
from kvfence.pd import protocol as p
from kvfence.pd.ioloop import IOLoop
from kvfence.pd.pairing import pairing_problem
from kvfence.pd.stats import TransferStats
from kvfence.pd.transport.tcp import Connection

log = logging.getLogger("kvfence.pd.decode")

# Runs of one connection being checked and written off the loop while the next ones arrive.
_RUNS_IN_FLIGHT = 2


@dataclass
class _Room:
    state: p.DecodeRoom
    peer: str
    pages: list[int]
    grant: Grant
    deadline: float
    started: float


@dataclass
class _Peer:
    conn: Connection | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    rooms: set[str] = field(default_factory=set)


class DecodeService:
    def __init__(
        self,
        engine: Engine,
        info: dict[str, Any],
        timeout_s: float = 30.0,
        guards: p.Guards = p.ALL_ON,
        mooncake: Any = None,
        secret: bytes = b"",
    ) -> None:
        self.engine = engine
        self.secret = secret  # I8: every frame is MACed under keys derived from it
        # Set: prefill writes our pool one-sidedly; we cannot veto a write, only verify it.
        self.mooncake = mooncake
        if mooncake is not None:
            info = {**info, "mooncake": mooncake.descriptor()}
        self.guards = guards  # every guard on, except in a test's mutation twin
        self.info = info
        self.timeout_s = timeout_s
        self.rooms: dict[str, _Room] = {}
        self.peers: dict[str, _Peer] = {}
        self.transfer_stats = TransferStats("decode")
        self.pairing_errors: dict[str, str] = {}
        self.io = IOLoop("kvfence-decode-io")
        self.loop = self.io.loop
        # Checksums and writes of received runs: one thread, so a connection's runs land in
        # order; numpy and xxhash release the GIL over whole blocks, so the loop keeps receiving.
        self._kv_writer = ThreadPoolExecutor(1, thread_name_prefix="kvfence-decode-kv")
        engine.hooks = self

    # ---- the engine facade the HTTP layer talks to ------------------------------------------

    def submit(self, req: GenerateRequest, sink: Any) -> Admitted | Rejected:
        """The decode door: admission, then the engine reserves pages and calls on_reserved."""
        if not req.peer:
            return Rejected(
                req.request_id,
                "pd_route_required",
                "This is a decode worker: send requests through the kvfence router.",
            )
        return self.engine.submit(req, sink, SeqMode.DECODE_ONLY)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.start()
        self.io.on_stop(self._close_all)
        self.io.start(self._begin())

    def shutdown(self) -> None:
        self.io.stop()
        self._kv_writer.shutdown(wait=True)
        self.engine.shutdown()

    async def _begin(self) -> None:
        asyncio.ensure_future(self._expire())

    def _close_all(self) -> None:
        for peer in list(self.peers.values()):
            if peer.conn is not None:
                peer.conn.close()

    def pd_metrics(self) -> Any:
        return self.transfer_stats.metrics(self.engine.stats().pages_handoff)

    def pd_info(self) -> dict[str, Any]:
        return {
            "role": "decode",
            "bootstrap_host": None,
            "bootstrap_port": None,
            "model": self.engine.model_name,
            "context_length": self.engine.context_length,
            "page_size": self.engine.pool.page_size,
            "pairing_errors": dict(self.pairing_errors),
            "counters": self.transfer_stats.snapshot(),
            "transfer_marks": self.transfer_stats.marks(),
            "pairing": {k: v for k, v in self.info.items() if k != "mooncake"},
        }

    # ---- engine hooks (engine thread) -----------------------------------------------------------

    def on_reserved(self, seq: Sequence) -> None:
        req = seq.admitted.request
        assert seq.grant is not None and req.peer is not None
        reserve = p.Reserve(
            room=seq.request_id,
            tenant=req.tenant,
            prompt=req.prompt_token_ids,
            sampling=_sampling_dict(req),
            max_tokens=seq.admitted.max_tokens,
            dst_pages=tuple(seq.pages),
            grant=seq.grant.grant_id,
        )
        self.loop.call_soon_threadsafe(self._reserve, reserve, req.peer, seq.grant)

    def on_prefilled(self, seq: Sequence) -> None:  # pragma: no cover - prefill only
        raise AssertionError("a decode engine never prefills for a transfer")

    def on_abort(self, seq: Sequence) -> None:
        self.loop.call_soon_threadsafe(self._feed, seq.request_id, p.ClientAborted())

    # ---- rooms ----------------------------------------------------------------------------------

    def _reserve(self, r: p.Reserve, peer_addr: str, grant: Grant) -> None:
        self.transfer_stats.inc("reserved")
        room = p.DecodeRoom(r.room, len(r.prompt), len(r.dst_pages))
        self.rooms[r.room] = _Room(
            room,
            peer_addr,
            list(r.dst_pages),
            grant,
            time.monotonic() + self.timeout_s,
            time.monotonic(),
        )
        asyncio.ensure_future(self._send_reserve(r, peer_addr))

    async def _send_reserve(self, r: p.Reserve, peer_addr: str) -> None:
        peer = await self._peer(peer_addr)
        if peer.conn is None or peer.conn.closed:
            # Never connected: no prefill can write these pages, so they may go at once.
            self._feed(r.room, p.ConnectionLost(), reason=peer.error)
            return
        peer.rooms.add(r.room)
        try:
            await peer.conn.send(r)
        except ConnectionError:
            pass  # the reader task feeds ConnectionLost for every room of this peer
        if faults.active("client_disconnect"):
            # The client hangs up mid-transfer: by then prefill is computing or sending.
            asyncio.get_running_loop().call_later(0.5, self.engine.abort, r.room)

    async def _peer(self, addr: str) -> _Peer:
        peer = self.peers.get(addr)
        if peer is None:
            peer = self.peers[addr] = _Peer()
            asyncio.ensure_future(self._connect(addr, peer))
        await peer.ready.wait()
        return peer

    async def _connect(self, addr: str, peer: _Peer) -> None:
        try:
            host, port = addr.rsplit(":", 1)
            conn = await Connection.open(host, int(port), self.timeout_s, self.secret)
            client_nonce = auth.new_nonce()
            await conn.send(wire.Hello({**self.info, "nonce": client_nonce}))
            msg, _ = await asyncio.wait_for(conn.recv(), self.timeout_s)
            if isinstance(msg, wire.HelloRefused):
                self.transfer_stats.inc("pairing_refused")
                self.pairing_errors[addr] = msg.reason
                raise ConnectionError(f"prefill {addr} refused to pair: {msg.reason}")
            if not isinstance(msg, wire.HelloOk):
                raise wire.WireError("expected HelloOk")
            problem = pairing_problem(self.info, msg.info)
            if problem is not None:
                self.transfer_stats.inc("pairing_refused")
                self.pairing_errors[addr] = problem
                raise ConnectionError(f"refusing to pair with prefill {addr}: {problem}")
            self.pairing_errors.pop(addr, None)
            conn.start_session(client_nonce, str(msg.info.get("nonce", "")))
            peer.conn = conn
        except (TimeoutError, OSError, ConnectionError, ValueError) as e:
            log.error("cannot use prefill %s: %s", addr, e)
            peer.error = str(e) or type(e).__name__
            self.peers.pop(addr, None)  # the next request tries again
            peer.ready.set()
            return
        peer.ready.set()
        await self._read(addr, peer)

    async def _read(self, addr: str, peer: _Peer) -> None:
        assert peer.conn is not None
        conn = peer.conn
        writing: deque[asyncio.Future] = deque()  # runs handed to the writer, in arrival order
        try:
            while True:
                msg, payload = await conn.recv()
                if isinstance(msg, wire.PageRun):
                    applied = self._on_run(conn, msg, payload)
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
            if isinstance(e, wire.WireError):
                self.transfer_stats.inc("bad_frames")
            log.warning("connection to prefill %s ended: %s", addr, e)
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

    def _on_run(
        self, conn: Connection, run: wire.PageRun, payload: memoryview
    ) -> asyncio.Future | None:
        """A run of pages: every page is checked (position, size, checksum, grant) on its own,
        the good ones are written in one batch, and the state machine sees the run as one
        RunArrived. Checks and writes of a framed run go to the writer thread (the Future)."""
        room = self.rooms.get(run.room)
        if room is None or room.state.state is not p.DState.RESERVED:
            # the tcp receiver can refuse a late write
            self.transfer_stats.inc("late_writes_dropped", len(run.checksums))
            return None
        self.transfer_stats.mark(run.room, "first_page")
        pool = self.engine.pool
        n = len(run.checksums)
        one_sided = self.mooncake is not None
        expected = 0 if one_sided else n * kvio.payload_size(pool, run.n_tokens)
        ok_shape = (
            0 <= run.first
            and run.first + n <= len(room.pages)
            and 0 < run.n_tokens <= pool.page_size
            and payload.nbytes == expected
        )
        if not ok_shape:
            self._run_applied(run, [False] * n, 0, 0)
            return None
        pages = room.pages[run.first : run.first + n]
        check = self._guards().on("checksum")  # off: mutation twin, the bytes as they come
        if one_sided:
            # The bytes are already in the pool; the read-back digest at DONE checks them.
            self._run_applied(run, *self._write_run(run, pages, room.grant, None, check))
            return None
        buf = conn.keep()  # the payload stays ours until the writer is done with it
        # Handed to the writer now, not from a task: the loop may read several buffered frames
        # before it next yields, and the writer would sit idle meanwhile.
        written = self.loop.run_in_executor(
            self._kv_writer, self._write_run, run, pages, room.grant, payload, check
        )

        async def apply() -> None:
            try:
                result = await written
            finally:
                if buf is not None:
                    conn.give_back(buf)
            self._run_applied(run, *result)

        return asyncio.ensure_future(apply())

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
        pool = self.engine.pool
        n = len(pages)
        intact = [True] * n
        data = None
        if payload is not None:
            size = run.n_tokens * kvio.token_bytes(pool)
            data = torch.frombuffer(payload, dtype=torch.uint8).view(2, pool.num_layers, n, size)
            if check:
                got = kvio.run_checksums(data)
                intact = [g == c for g, c in zip(got, run.checksums, strict=True)]
        # I2 on the write path: every destination page must still belong to this room's grant
        # and tenant.
        owned = pool.check_destination(grant, pages)
        if faults.active("skip_dest_check"):
            owned = [True] * n
        foreign = owned.count(False)
        if foreign:
            intact = [i and o for i, o in zip(intact, owned, strict=True)]
        good = [i for i, ok in enumerate(intact) if ok]
        if data is None or not good:
            return intact, foreign, 0
        which = None if len(good) == n else good
        dst = [pages[i] for i in good]
        kvio.scatter(pool, dst, run.n_tokens, data, which)
        pool.mark_written(grant, dst)
        return intact, foreign, len(good)

    def _run_applied(
        self, run: wire.PageRun, intact: list[bool], foreign: int, written: int
    ) -> None:
        pool = self.engine.pool
        if foreign:
            self.transfer_stats.inc("grant_mismatches", foreign)
        if written:
            self.transfer_stats.inc("pages_received", written)
            self.transfer_stats.inc(
                "bytes_received", written * kvio.payload_size(pool, run.n_tokens)
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
        if run.first == 0 and faults.active("kill_decode"):
            os._exit(137)

    def _on_done(self, done: p.Done) -> None:
        room = self.rooms.get(done.room)
        ok = False
        if room is not None and room.state.state is p.DState.RESERVED:
            ok = self._pool_matches(room, done)
        self._feed(done.room, p.DoneArrived(done, ok))
        if room is not None:
            marks = self.transfer_stats
            end = marks.mark(done.room, "done_handled")
            first = marks.mark(done.room, "first_page", end)
            marks.observe_phase("receive", end - first)

    def _pool_matches(self, room: _Room, done: p.Done) -> bool:
        """Read the pages back from the pool and hash them: what decode will attend to must be
        exactly what prefill computed, whatever wrote it (late, foreign or one-sided writes)."""
        if done.n_tokens != room.state.n_tokens or done.n_pages != len(room.pages):
            return False
        sums = kvio.pool_checksums(self.engine.pool, room.pages, done.n_tokens)
        return p.digest_of(tuple(enumerate(sums)), done.n_tokens) == done.digest

    def _feed(self, rid: str, event: Any, reason: str | None = None) -> None:
        room = self.rooms.get(rid)
        if room is None:
            if isinstance(event, p.AbortArrived):
                self._send(rid, None, p.AbortAck(rid))
            return
        room.state, actions = p.decode_step(room.state, event, self._guards())
        if room.state.state in (p.DState.RELEASED, p.DState.COMMITTED):
            del self.rooms[rid]
            peer = self.peers.get(room.peer)
            if peer is not None:
                peer.rooms.discard(rid)
        for a in actions:
            if isinstance(a, p.Send):
                self._send(rid, room.peer, a.message)
            elif isinstance(a, p.Commit):
                if self.mooncake is not None:
                    # One-sided writes left no trace; the verified digest vouches for the pages.
                    self.engine.pool.mark_written(room.grant, room.pages)
                self.transfer_stats.inc("transfers_committed")
                self.transfer_stats.observe_latency(time.monotonic() - room.started)
                self.engine.commit(rid, a.first_token, a.first_logprobs)
            elif isinstance(a, p.FailClient):
                self.transfer_stats.inc(f"transfers_failed_{a.code}")
                message = a.message if reason is None else f"{a.message}: {reason}"
                self.engine.fail(rid, message, a.code, a.status)
            elif isinstance(a, p.ReleasePages):
                self.engine.release(rid)

    def _guards(self) -> p.Guards:
        off = set(self.guards.off)
        for fault, guard in _FAULT_GUARDS.items():
            if faults.active(fault):
                off.add(guard)
        return p.Guards(frozenset(off)) if off else p.ALL_ON

    def _send(self, rid: str, peer_addr: str | None, msg: p.Message) -> None:
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

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for rid, room in list(self.rooms.items()):
                if now <= room.deadline:
                    continue
                if room.state.state is p.DState.RESERVED:
                    room.deadline = now + self.timeout_s
                    self._feed(rid, p.TimedOut())
                elif room.state.state is p.DState.ABORTING:
                    # No ack within a second timeout: fence by closing the connection; its
                    # reader then stops and every room on it is released safely.
                    peer = self.peers.get(room.peer)
                    if peer is not None and peer.conn is not None:
                        log.error(
                            "no ABORT_ACK for room %s: closing connection to %s", rid, room.peer
                        )
                        peer.conn.close()
                    room.deadline = now + self.timeout_s


def _sampling_dict(req: GenerateRequest) -> dict[str, Any]:
    sp = req.sampling
    return {
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "seed": sp.seed,
        "stop": list(sp.stop),
        "stop_token_ids": list(sp.stop_token_ids),
        "ignore_eos": sp.ignore_eos,
        "logprobs": sp.logprobs,
    }


# Fault points that switch off a protocol guard on the decode side (tests only).
_FAULT_GUARDS = {
    "skip_count_check": "count_check",
    "skip_checksum": "checksum",
    "early_release": "deferred_release",
}
