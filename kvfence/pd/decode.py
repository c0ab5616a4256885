"""DecodeService: the KV receiver. Its room table (this file, on the IO loop) reserves pages and
sends RESERVE, feeds each room's events to pd/protocol.py's decode machine through pd/glue.py and
carries out what it decides: verify DONE against a read-back of the pool (I3) and commit, fail
the client, free a room's pages only once prefill can no longer write them (I4). Its parts: the
prefill connections (pd/peers.py `Dialer`), the page runs' reader and writer (pd/decode_runs.py),
the pool port (pd/pool_port.py), the only way into the pool from here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from functools import partial
from typing import Any

from kvfence.config import EngineConfig
from kvfence.engine.admission import Admitted, Rejected
from kvfence.engine.request import GenerateRequest
from kvfence.engine.sequence import SeqMode, Sequence
from kvfence.engine.step_budget import AUTO_STEP_FACTOR
from kvfence.engine.tp_group import TpBroken
from kvfence.faults import Faults
from kvfence.kv.pool import Grant
from kvfence.pd import glue, kvio, wire
from kvfence.pd import protocol as p
from kvfence.pd.decode_runs import Room, RunReceiver
from kvfence.pd.local_prefill import (
    LOCAL_BACKLOG_STEPS,
    LOCAL_LIMIT_CHUNKS,
    LocalPace,
    PendingPrompts,
)
from kvfence.pd.peers import UNAVAILABLE, Dialer
from kvfence.pd.pool_port import PortRuleBroken
from kvfence.pd.service import PdService
from kvfence.pd.tls import TlsConfig
from kvfence.pd.transport.link import page_receiver
from kvfence.pd.transport.tcp import LinkLimits, resolve

log = logging.getLogger("kvfence.pd.decode")

_Room = Room  # the room table's entry, as the tests build one

__all__ = ["UNAVAILABLE", "DecodeService"]


class DecodeService(PdService):
    role = "decode"

    def __init__(
        self,
        cfg: EngineConfig,
        timeout_s: float = 30.0,
        backend: str = "tcp",
        tls: TlsConfig | None = None,
        faults: Faults | None = None,
        host: str = "127.0.0.1",
        limits: LinkLimits | None = None,
        local_prefill: float = 0.0,
        borrow_threads: int = 0,
    ) -> None:
        """host: where this worker is reachable (a Mooncake peer's one-sided writes go there);
        local_prefill: --decode-local-prefill, how much slower a prompt computed here may be than
        at the prefill worker and still go here (pd/local_prefill.py; 0: never);
        borrow_threads: --decode-borrow-threads, the threads its steps add to --threads while
        none of its prompts is at the prefill worker (PendingPrompts.step_threads; 0: never)."""
        # Waived preflight (tests only) lets the two roles' pools differ (the incident's fault
        # 1): a prompt's fate must not then depend on which side computes it.
        local_prefill = 0.0 if cfg.unsafe_skip_preflight else local_prefill
        if local_prefill > 0:
            # Its prompts have the prefill worker to go to: no wide step target, and no backlog
            # share beyond the time target (local_prefill.py: the queue is priced at it).
            cfg = replace(
                cfg, wide_step_factor=AUTO_STEP_FACTOR, prefill_backlog_steps=LOCAL_BACKLOG_STEPS
            )
        self._takes_prompts = local_prefill > 0
        super().__init__(cfg, backend, tls, faults, timeout_s, limits)
        limit = LOCAL_LIMIT_CHUNKS * cfg.chunked_prefill_size
        self.pending = PendingPrompts(local_prefill, limit)
        own = cfg.threads
        if borrow_threads > 0 and own is not None and cfg.device == "cpu" and cfg.tp_size == 1:
            self.engine.step_threads = lambda: self.pending.step_threads(own, borrow_threads)
        self.chunk = cfg.chunked_prefill_size
        self.ranks = cfg.tp_size  # a run's payload carries every rank's slice
        # One-sided writes land anywhere in the registered pool: no grant to check them by (I3
        # and I4 carry those); the tcp receiver writes only through the port.
        self.link = page_receiver(backend, self.pool_port.view, host)
        setup = self._peer_setup(cfg)
        self.rooms: dict[str, Room] = {}
        self.receiver = RunReceiver(
            self.rooms, self.pool_port, self.link, self.faults, self.transfer_stats, self.ranks,
            self._feed, self._on_message,
        )  # fmt: skip
        hello = {**self.pairing, **self.link.hello_info()}
        self.dialer = Dialer(setup, hello, self.receiver.read, self._connection_lost)
        self.peers = self.dialer.peers  # one connection per resolved prefill address
        self.pairing_errors = self.dialer.pairing_errors

    def _holds_tpot(self, cfg: EngineConfig) -> bool:
        # Its rows decode nowhere else; its prompts have the prefill worker (local_prefill.py).
        return self._takes_prompts

    # ---- the role the HTTP layer talks to ------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Any) -> Admitted | Rejected:
        """The decode door: admission, then the engine reserves pages and calls on_reserved."""
        if not req.peer:
            return Rejected(
                req.request_id,
                "pd_route_required",
                "This is a decode worker: send requests through the kvfence router.",
            )
        n = len(req.prompt_token_ids)
        local = self.pending.claim(n, self._pace)
        mode = SeqMode.FULL if local else SeqMode.DECODE_ONLY
        verdict = self.engine.submit(req, self.pending.sink(local, n, sink), mode)
        if isinstance(verdict, Rejected):
            self.pending.settle(local, n)
        elif local:
            self.transfer_stats.inc("prefilled_here")
        return verdict

    def _pace(self, remote: int) -> LocalPace | None:
        """What a prompt token costs here and at the prefill worker, from this engine's steps
        (read from the submitting thread: StepBudget.beside is one attribute, and at_target
        pure), with at least the `remote` prompts' rows decoding beside it."""
        budget = self.engine.scheduler.step_budget
        beside = budget.beside()
        if beside is None:
            return None
        cost, rows = beside
        rows = max(rows, remote)
        return LocalPace.of(cost, rows, budget.at_target(cost, rows), self.chunk)

    def info(self) -> dict[str, Any]:
        return {
            **self._info(),
            "bootstrap_host": None,
            "bootstrap_port": None,
            "pairing_errors": dict(self.pairing_errors),
            "pairing": dict(self.pairing),
        }

    def _close_all(self) -> None:
        self.dialer.close_all()

    # ---- engine hooks (engine thread) -----------------------------------------------------------

    def on_reserved(self, seq: Sequence) -> None:
        req = seq.admitted.request
        assert seq.grant is not None and req.peer is not None
        self.pool_port.hand_over(seq.grant)  # parked in HANDOFF: the pages are the IO loop's now
        cached = seq.num_sealed  # the scheduler's hit: cache pages the sequence references
        namespaces = self.faults.guards().on("prefix_namespace")
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
            # What the cache pages hold, as the cache recorded it when they were sealed.
            prefix_digest=self.pool_port.held_digest(seq.pages[:cached], namespaces)
            if cached
            else "",
            lora_name=req.lora.name if req.lora is not None else "",
            lora_digest=req.lora.digest if req.lora is not None else "",
        )
        self.loop.call_soon_threadsafe(
            self._reserve, reserve, req.peer, seq.grant, list(seq.pages), cached
        )

    def on_prefilled(self, seq: Sequence) -> None:  # pragma: no cover - prefill only
        raise AssertionError("a decode engine never prefills for a transfer")

    def on_abort(self, seq: Sequence) -> None:
        self.loop.call_soon_threadsafe(self._feed, seq.request_id, p.ClientAborted())

    # ---- the room table (IO loop) ---------------------------------------------------------------

    def _reserve(
        self, r: p.Reserve, peer_addr: str, grant: Grant, pages: list[int], cached: int
    ) -> None:
        self.transfer_stats.inc("reserved")
        view = self.pool_port.view
        room = p.DecodeRoom(
            r.room, len(r.prompt), len(pages), cached_pages=cached, cached_tokens=r.cached_tokens,
            lora_digest=r.lora_digest,
        )
        now = time.monotonic()
        entry = Room(room, None, pages, grant, now + self.timeout_s, now, cached)
        self.rooms[r.room] = entry
        # The cached prefix as it is now: the read-back at DONE must find it unchanged.
        try:
            if cached:
                entry.prefix_sums = self.pool_port.checksums(grant, pages[:cached], r.cached_tokens)
                self.faults.hook("stale_cached_page", pages, tensors=self.pool_port.pages(grant))
        except TpBroken:
            pass  # the engine failed closed: this room's client has its error already
        except PortRuleBroken as e:  # a bug of this service: the room fails closed, nothing sent
            self.transfer_stats.inc("port_rule_broken")
            log.error("room %s: %s", r.room, e)
            self._feed(r.room, p.ConnectionLost(), reason=UNAVAILABLE)
            return
        self.transfer_stats.inc("prompt_tokens", len(r.prompt))
        self.transfer_stats.inc("prefix_cached_tokens", r.cached_tokens)
        self.transfer_stats.inc(
            "bytes_not_transferred", cached * self.ranks * kvio.payload_size(view, view.page_size)
        )
        asyncio.ensure_future(self._send_reserve(r, peer_addr))

    async def _send_reserve(self, r: p.Reserve, peer_addr: str) -> None:
        try:
            key = await asyncio.wait_for(resolve(peer_addr), self.timeout_s)
        except (TimeoutError, OSError, ValueError) as e:
            log.error("cannot resolve prefill %r: %s", peer_addr, e)
            self._feed(r.room, p.ConnectionLost(), reason=UNAVAILABLE)
            return
        peer = await self.dialer.peer(key)
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
        self.faults.hook("client_disconnect", None, abort=partial(self.engine.abort, r.room))

    def _connection_lost(self, rids: set[str]) -> None:
        for rid in rids:
            self._feed(rid, p.ConnectionLost())

    def _on_message(self, msg: wire.Frame) -> None:
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

    def _pool_matches(self, room: Room, done: p.Done) -> bool:
        """Read every page decode will attend to back from the pool and hash it: the sent ones
        must be exactly what prefill computed, whatever wrote them (late, foreign or one-sided
        writes), and the cached prefix exactly what it held when RESERVE went out."""
        if done.n_tokens != room.state.n_tokens or done.n_pages != len(room.pages):
            return False
        try:
            sums = self.pool_port.checksums(room.grant, room.pages, done.n_tokens)
        except TpBroken:
            return False  # a rank's slice cannot be read back: nothing to commit
        k = room.cached
        if sums[:k] != room.prefix_sums:
            return False
        return p.digest_of(tuple(enumerate(sums[k:])), done.n_tokens) == done.digest

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
            self.dialer.room_ended(room.peer, rid)

    def _committed(self, rid: str, room: Room, first_token: int, first_logprobs: dict) -> None:
        self.link.committed(self.pool_port, room.grant, room.reserved)
        self.transfer_stats.inc("transfers_committed")
        self.transfer_stats.observe_latency(time.monotonic() - room.started)
        self.pool_port.commit(rid, room.grant, first_token, first_logprobs)

    def _tick(self, now: float) -> None:
        self.dialer.close_idle(now)
        for rid, room in list(self.rooms.items()):
            if now <= room.deadline:
                continue
            if room.state.state is p.DState.RESERVED:
                room.deadline = now + self.timeout_s
                self._feed(rid, p.TimedOut())
            elif room.state.state is p.DState.ABORTING:
                # No ack within a second timeout: fence by closing the connection.
                self.dialer.fence(room.peer, rid)
                room.deadline = now + self.timeout_s


class _RoomEffects:
    """What decode's glue actions do to one room (glue.DecodeEffects), on the io loop."""

    def __init__(
        self, svc: DecodeService, rid: str, room: Room | None, reason: str | None
    ) -> None:
        self.svc, self.rid, self.room, self.reason = svc, rid, room, reason

    def send(self, message: p.Message) -> None:
        # A room decode forgot has no route back: its peer is unknown, the message goes nowhere.
        sent = self.svc.dialer.send(None if self.room is None else self.room.peer, message)
        if sent and isinstance(message, p.Abort):
            self.svc.transfer_stats.inc("aborts_sent")

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
