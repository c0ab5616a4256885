"""PrefillService: the bootstrap endpoint decode workers connect to, and the KV sender. Its room
table (this file, on the IO loop) feeds each room's events to pd/protocol.py's prefill machine
through pd/glue.py and carries out what it decides: admission (the third door) through the same
Engine.submit every role uses, compute in PREFILL_ONLY mode, send the pages, then DONE; source
pages are held until DONE_ACK or an abort (I4). Its parts: the decode connections (pd/peers.py
`Bootstrap`), the page sender (pd/prefill_send.py), the pool port (pd/pool_port.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvfence.config import EngineConfig
from kvfence.engine.admission import Admitted, Rejected
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.engine.sequence import SeqMode, Sequence
from kvfence.faults import Faults
from kvfence.kv.prefix import Namespace, held_digest, lora_identity
from kvfence.lora.checkpoint import LoraAdapter
from kvfence.pd import glue, wire
from kvfence.pd import protocol as p
from kvfence.pd.peers import Bootstrap, send_after
from kvfence.pd.prefill_send import Room, RoomSender
from kvfence.pd.service import PdService
from kvfence.pd.tls import TlsConfig
from kvfence.pd.transport.link import page_sender
from kvfence.pd.transport.tcp import Connection, LinkLimits, Listener

log = logging.getLogger("kvfence.pd.prefill")


class PrefillService(PdService):
    role = "prefill"

    def __init__(
        self,
        cfg: EngineConfig,
        host: str,
        port: int,
        timeout_s: float = 30.0,
        backend: str = "tcp",
        tls: TlsConfig | None = None,
        faults: Faults | None = None,
        limits: LinkLimits | None = None,
    ) -> None:
        super().__init__(cfg, backend, tls, faults, timeout_s, limits)
        self.host, self.port = host, port
        # What decode workers should dial: the bind address unless it is a wildcard.
        self.advertise_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.link = page_sender(backend, self.pool_port.view, self.advertise_host)
        setup = self._peer_setup(cfg)
        self.rooms: dict[str, Room] = {}
        self.sender = RoomSender(
            self.pool_port, self.link, self.faults, self.transfer_stats, cfg.tp_size, self._feed
        )
        self.bootstrap = Bootstrap(setup, self.link, self._on_message, self._connection_lost)

    @property
    def _server(self) -> Listener | None:
        return self.bootstrap.server

    async def _begin(self) -> None:
        self.port = await self.bootstrap.listen(self.host, self.port)
        await super()._begin()

    def _close_all(self) -> None:
        self.bootstrap.close_all()

    def info(self) -> dict[str, Any]:
        return {
            **self._info(),
            "bootstrap_host": self.advertise_host,
            "bootstrap_port": self.port,
            "pairing": dict(self.pairing),
        }

    # ---- the role the HTTP layer talks to ------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Any) -> Admitted | Rejected:
        """Prefill work arrives as RESERVEs from decode workers, never over HTTP."""
        return Rejected(
            req.request_id,
            "pd_route_required",
            "This is a prefill worker: send requests through the kvfence router.",
        )

    # ---- engine hooks (engine thread) -----------------------------------------------------------

    def on_prefilled(self, seq: Sequence) -> None:
        assert seq.grant is not None
        self.pool_port.hand_over(seq.grant)  # parked in HANDOFF: the pages are the IO loop's now
        self.loop.call_soon_threadsafe(self._prefilled, seq)

    def on_reserved(self, seq: Sequence) -> None:  # pragma: no cover - decode only
        raise AssertionError("a prefill engine never reserves for a transfer")

    def on_abort(self, seq: Sequence) -> None:
        # Only this service aborts prefill sequences; by then the room is closed.
        self.pool_port.release(seq.request_id, seq.grant)

    # ---- the room table (IO loop) ---------------------------------------------------------------

    def _connection_lost(self, conn: Connection) -> None:
        for rid, room in list(self.rooms.items()):
            if room.conn is conn:
                self._feed(rid, p.ConnectionLost())

    def _on_message(self, conn: Connection, msg: wire.Frame) -> None:
        if isinstance(msg, p.Reserve):
            self._on_reserve(conn, msg)
        elif isinstance(msg, p.Abort):
            self._feed(msg.room, p.AbortArrived(msg), conn)
        elif isinstance(msg, p.DoneAck):
            self._feed(msg.room, p.DoneAckArrived(), conn)
        elif isinstance(msg, p.AbortAck):
            # Decode's answer to an ABORT of ours (a refusal at this door, a timeout, a failed
            # source check): that ABORT closed the room and fenced it, so nothing is left to do
            # (formal/model.py models it so). Not a bad frame: dropping the connection for it
            # would fail every other room of that decode.
            pass
        elif isinstance(msg, wire.Heartbeat):
            pass
        else:
            raise wire.WireError(f"unexpected {type(msg).__name__} from decode")

    def _on_reserve(self, conn: Connection, r: p.Reserve) -> None:
        self.transfer_stats.inc("reserves")
        if r.room in self.rooms:
            # A second RESERVE for a live room: abort the live room too, so the ABORT we answer
            # with (sent after any write of it) really fences the pages decode reserved.
            self.transfer_stats.inc("room_collisions")
            live = self.rooms[r.room]
            collision = p.Abort(r.room, "room_collision", "room in use", 409)
            if live.conn is conn:
                self._feed(r.room, p.AbortArrived(collision), conn)
            asyncio.ensure_future(send_after(live.writing, conn, collision))
            return
        verdict: Any
        req: GenerateRequest | None = None
        try:
            # max_tokens as decode's admission resolved it (the request's may be None).
            sampling = replace(SamplingParams.from_dict(r.sampling), max_tokens=r.max_tokens)
            lora = self._lora(r)
            req = GenerateRequest(
                r.room, r.tenant, r.prompt, sampling, cache_salt=r.cache_salt or None, lora=lora
            )
            problem = self._prefix_problem(r, lora)
            if r.lora_digest and lora is None:
                # Decode resolved an adapter this prefill does not serve (or not to this
                # tenant): its KV would be the wrong model's. The workers' fault: a 500.
                verdict = Rejected(r.room, "lora_not_held",
                                   f"this prefill does not hold adapter {r.lora_name}", status=500)
            elif problem is not None:
                self.transfer_stats.inc("prefix_mismatches")
                # The workers' fault, not the client's: a 500, fail-closed.
                verdict = Rejected(r.room, "kv_prefix_mismatch", problem, status=500)
            else:
                verdict = self.engine.submit(req, self._compute_sink(r.room), SeqMode.PREFILL_ONLY)
        except (TypeError, ValueError) as e:
            verdict = Rejected(r.room, "invalid_request", f"bad RESERVE: {e}")
        verdict = self.faults.hook(
            "placeholder_on_reject", verdict, rejected=isinstance(verdict, Rejected), request=req,
            engine=self.engine, mode=SeqMode.PREFILL_ONLY,
        )  # fmt: skip
        if isinstance(verdict, Rejected):
            self.transfer_stats.inc("rejected")
            event = p.ReserveArrived(False, verdict.code, verdict.message, verdict.status)
        else:
            event = p.ReserveArrived(True)
        # Nothing of a room being opened is in flight yet: its sends need no fence.
        state = glue.prefill_start(r.room, event, _RoomEffects(self, r.room, conn, None))
        if state.state is not p.PState.CLOSED:
            now = time.monotonic()
            self.rooms[r.room] = Room(state, conn, r, now + self.timeout_s, now)

    def _compute_sink(self, rid: str) -> Callable[[RequestOutput], None]:
        """A room's sequence has no HTTP client: its result travels as pages and DONE. An error
        (the ownership check failed it, or the engine failed closed: a lost tensor-parallel rank)
        aborts the room at once rather than leaving decode to time it out."""

        def sink(out: RequestOutput) -> None:
            if out.finished and out.finish_reason is FinishReason.ERROR:
                failed = p.ComputeFailed(out.error_code or "engine_error", out.error or "failed")
                try:
                    self.loop.call_soon_threadsafe(self._feed, rid, failed)
                except RuntimeError:
                    pass  # the io loop is closed: the service is shutting down, rooms and all

        return sink

    def _lora(self, r: p.Reserve) -> LoraAdapter | None:
        """The adapter RESERVE names, by content digest, if this prefill serves it to r.tenant."""
        lora = self.engine.lora
        if not r.lora_digest or lora is None:
            return None
        return lora.registry.by_digest(r.lora_digest, r.tenant)

    def _prefix_problem(self, r: p.Reserve, lora: LoraAdapter | None = None) -> str | None:
        """Why RESERVE's cached-prefix claim cannot be honoured, or None: the count must be
        page-aligned and leave prefill at least the last token, the reserved pages must be the
        rest of the prompt, and what decode's cached pages hold (prefix_digest) must be this
        room's namespace and prompt tokens, as prefill recomputes them."""
        ps = self.pool_port.view.page_size
        k, rest = divmod(r.cached_tokens, ps)
        if rest or not 0 <= k <= (len(r.prompt) - 1) // ps:
            return (
                f"decode claims {r.cached_tokens} cached tokens of a {len(r.prompt)}-token prompt"
            )
        if len(r.dst_pages) != -(-len(r.prompt) // ps) - k:
            return f"decode reserved {len(r.dst_pages)} pages beyond its {k} cached ones"
        guards = self.faults.guards()
        if not guards.on("prefix_digest"):
            return None
        expected = ""
        if k:
            adapter = lora_identity(lora, self.faults)
            ns = Namespace.of_tenant(r.tenant, r.cache_salt or None, adapter)
            tokens = r.prompt[: k * ps]
            # Declared public pages are the shared namespace's on both sides (same
            # --shared-prefix-file); without a cache here every page is the tenant's.
            names = self.pool_port.prefix_namespaces(tokens, ns)
            pages = ((names[i], tokens[i * ps : (i + 1) * ps]) for i in range(k))
            expected = held_digest(pages, guards.on("prefix_namespace"))
        if r.prefix_digest != expected:
            return "decode's cached prefix does not hold this room's prompt and namespace"
        return None

    def _prefilled(self, seq: Sequence) -> None:
        room = self.rooms.get(seq.request_id)
        if room is None:
            self.pool_port.release(seq.request_id, seq.grant)  # aborted while computing
            return
        room.seq = seq
        room.first_token = seq.token_ids[-1]
        self.transfer_stats.inc("prompt_tokens", seq.prompt_len)
        self.transfer_stats.inc("prefix_cached_tokens", seq.cached_tokens)
        self._feed(seq.request_id, p.Prefilled())

    def _feed(self, rid: str, event: Any, conn: Connection | None = None) -> None:
        room = self.rooms.get(rid)
        if room is not None and conn is not None and room.conn is not conn:
            room = None  # a room of another connection: this peer cannot touch it
        fx = _RoomEffects(self, rid, conn if room is None else room.conn, room)
        state = glue.prefill_feed(
            rid, None if room is None else room.state, event, self.faults.guards(), fx
        )
        if room is None or state is None:
            return
        room.state = state
        if state.state is p.PState.CLOSED:
            del self.rooms[rid]

    def _tick(self, now: float) -> None:
        for rid, room in list(self.rooms.items()):
            if now > room.deadline:
                log.warning("room %s timed out in %s", rid, room.state.state.value)
                self._feed(rid, p.TimedOut())


class _RoomEffects:
    """What prefill's glue actions do to one room (glue.PrefillEffects), on the io loop. room is
    None for a room being opened or one prefill no longer holds."""

    def __init__(
        self, svc: PrefillService, rid: str, conn: Connection | None, room: Room | None
    ) -> None:
        self.svc, self.rid, self.conn, self.room = svc, rid, conn, room

    def send(self, message: p.Message, fenced: bool) -> None:
        if self.conn is None:
            return
        if isinstance(message, p.Abort):
            self.svc.transfer_stats.inc("aborts_sent")
        writing = self.room.writing if fenced and self.room is not None else None
        asyncio.ensure_future(send_after(writing, self.conn, message))

    def cancel_compute(self) -> None:
        self.svc.engine.abort(self.rid)

    def release(self) -> None:
        port, rid = self.svc.pool_port, self.rid
        grant = None if self.room is None or self.room.seq is None else self.room.seq.grant
        writing = None if self.room is None else self.room.writing
        if writing is not None and not writing.done():
            # A write (one-sided, or a send from the pages) may still read them: free after it.
            writing.add_done_callback(lambda _f: port.release(rid, grant))
        else:
            port.release(rid, grant)

    def stop_sending(self) -> None:
        if self.room is not None:
            self.room.stop_sending = True

    def send_pages(self) -> None:
        assert self.room is not None
        asyncio.ensure_future(self.svc.sender.send(self.rid, self.room))
