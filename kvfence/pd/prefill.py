"""PrefillService: the bootstrap endpoint decode workers connect to, and the KV sender.

Per room it runs protocol.prefill_step and executes the actions: admission (the third door)
through the same Engine.submit every role uses, compute in PREFILL_ONLY mode, stream the pages
with per-page checksums, then DONE; source pages are held until DONE_ACK or an abort (I4).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client.core import Metric

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.admission import Admitted, Rejected
from kvfence.engine.engine import Engine
from kvfence.engine.prompt_logprobs import attach
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.engine.sequence import SeqMode, Sequence
from kvfence.engine.tp_group import TpBroken
from kvfence.faults import Faults
from kvfence.kv.pool import SealedReads
from kvfence.kv.prefix import Namespace, held_digest
from kvfence.pd import glue, kvio, wire
from kvfence.pd import protocol as p
from kvfence.pd.ioloop import IOLoop
from kvfence.pd.pairing import model_fingerprint, node_info, pairing_problem
from kvfence.pd.pool_port import PoolPort
from kvfence.pd.stats import TransferStats
from kvfence.pd.tls import TlsConfig
from kvfence.pd.transport.link import RoomSend, page_sender
from kvfence.pd.transport.tcp import Connection, LinkLimits, Listener, RecordError
from kvfence.role import EngineRole
from kvfence.tp_layout import pd_tp_problem

log = logging.getLogger("kvfence.pd.prefill")


@dataclass
class _Room:
    state: p.PrefillRoom
    conn: Connection
    reserve: p.Reserve
    deadline: float
    started: float
    stop_sending: bool = False
    seq: Sequence | None = None
    first_token: int | None = None
    writing: asyncio.Future | None = None  # reads of the room's pages still under way


class PrefillService(EngineRole):
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
        self.faults = faults if faults is not None else Faults()
        if tls is None or tls.role != "prefill":
            raise ValueError("a prefill worker needs its prefill TLS certificate (I8)")
        problem = pd_tp_problem(cfg.tp_size, backend)
        if problem is not None:
            raise ConfigError(problem)
        super().__init__(Engine(cfg, self.faults, hooks=self))
        self.pool_port = PoolPort(self.engine, self.faults)  # this service's only way into the pool
        self.slices = self.pool_port.slices  # None: one rank holds whole pages
        self.tls = tls  # I8: every connection is mutual TLS with decode certificates
        self.limits = limits or LinkLimits()
        self.host, self.port = host, port
        # What decode workers should dial: the bind address unless it is a wildcard.
        self.advertise_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        self.link = page_sender(backend, self.pool_port.view, self.advertise_host)
        self.pairing = node_info(
            self.engine, self.pool_port.view, "prefill", model_fingerprint(cfg.model), backend
        )
        if cfg.unsafe_skip_preflight:
            self.pairing["unsafe_skip_capacity"] = True
        self.timeout_s = timeout_s
        self.rooms: dict[str, _Room] = {}
        self.transfer_stats = TransferStats("prefill")
        self.io = IOLoop("kvfence-prefill-io")
        self.loop = self.io.loop
        self._server: Listener | None = None
        self._conns: set[Connection] = set()

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.start()
        self.io.on_stop(self._close_all)
        self.io.start(self._listen())

    def shutdown(self) -> None:
        self.io.stop()
        self.link.close()
        self.engine.shutdown()

    async def _listen(self) -> None:
        self._server = await Listener.start(
            self.host,
            self.port,
            self._serve_conn,
            self.tls,
            self.faults,
            max_pending=self.limits.max_pending_handshakes,
            handshake_timeout=self.limits.handshake_timeout_s,
            on_refused=lambda reason: self.transfer_stats.inc(f"handshakes_refused_{reason}"),
        )
        self.port = self._server.port
        asyncio.ensure_future(self._expire())

    def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.close()

    def metrics(self) -> Iterable[Metric]:
        return self.transfer_stats.metrics(self.engine.stats().pages_handoff)

    def info(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "bootstrap_host": self.advertise_host,
            "bootstrap_port": self.port,
            "model": self.engine.model_name,
            "context_length": self.engine.context_length,
            "page_size": self.pool_port.view.page_size,
            "counters": self.transfer_stats.snapshot(),
            "transfer_marks": self.transfer_stats.marks(),
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

    # ---- connections ----------------------------------------------------------------------------

    async def _serve_conn(self, conn: Connection) -> None:
        self._conns.add(conn)
        try:
            if not await self._handshake(conn):
                return
            while True:
                msg, payload = await conn.recv()
                self._on_message(conn, msg)
        except asyncio.CancelledError:
            pass  # shutting down: asyncio would log a cancelled connection callback as an error
        except (ConnectionError, wire.WireError, asyncio.IncompleteReadError, TimeoutError) as e:
            if isinstance(e, (wire.WireError, RecordError)):
                # Malformed, or a record TLS refused (forged, replayed, injected): counted, the
                # connection dropped, nothing else.
                self.transfer_stats.inc("bad_frames")
                log.warning("dropping connection from %s: %s", conn.peer, e)
        finally:
            conn.close()
            self._conns.discard(conn)
            self.link.peer_left(conn)
            for rid, room in list(self.rooms.items()):
                if room.conn is conn:
                    self._feed(rid, p.ConnectionLost())

    async def _handshake(self, conn: Connection) -> bool:
        """The pairing facts (I7), exchanged inside this connection's TLS session: the decode
        proved its certificate before a byte of this was read."""
        msg, _ = await asyncio.wait_for(conn.recv(), self.timeout_s)
        if not isinstance(msg, wire.Hello):
            raise wire.WireError("expected Hello")
        problem = pairing_problem(self.pairing, msg.info, self.faults.guards())
        if problem is not None:
            self.transfer_stats.inc("pairing_refused")
            log.error("refusing to pair with decode %s: %s", conn.peer, problem)
            await conn.send(wire.HelloRefused(problem))
            return False
        self.link.peer_joined(conn, msg.info)
        await conn.send(wire.HelloOk(dict(self.pairing)))
        return True

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
            asyncio.ensure_future(_send_after(live.writing, conn, collision))
            return
        verdict: Any
        try:
            # max_tokens as decode's admission resolved it (the request's may be None).
            sampling = replace(SamplingParams.from_dict(r.sampling), max_tokens=r.max_tokens)
            req = GenerateRequest(
                r.room, r.tenant, r.prompt, sampling, cache_salt=r.cache_salt or None
            )
            problem = self._prefix_problem(r)
            if problem is not None:
                self.transfer_stats.inc("prefix_mismatches")
                # The workers' fault, not the client's: a 500, fail-closed.
                verdict = Rejected(r.room, "kv_prefix_mismatch", problem, status=500)
            else:
                verdict = self.engine.submit(req, self._compute_sink(r.room), SeqMode.PREFILL_ONLY)
        except (TypeError, ValueError) as e:
            verdict = Rejected(r.room, "invalid_request", f"bad RESERVE: {e}")
        if isinstance(verdict, Rejected) and self.faults.active("placeholder_on_reject"):
            # The incident's engine bug, on purpose: keep going with a 1-token stand-in.
            one = GenerateRequest(
                r.room, r.tenant, r.prompt[:1] or (0,), SamplingParams(max_tokens=1)
            )
            verdict = self.engine.submit(one, _ignore, SeqMode.PREFILL_ONLY)
        if isinstance(verdict, Rejected):
            self.transfer_stats.inc("rejected")
            event = p.ReserveArrived(False, verdict.code, verdict.message, verdict.status)
        else:
            event = p.ReserveArrived(True)
        # Nothing of a room being opened is in flight yet: its sends need no fence.
        state = glue.prefill_start(r.room, event, _RoomEffects(self, r.room, conn, None))
        if state.state is not p.PState.CLOSED:
            now = time.monotonic()
            self.rooms[r.room] = _Room(state, conn, r, now + self.timeout_s, now)

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

    def _prefix_problem(self, r: p.Reserve) -> str | None:
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
            ns = Namespace.of_tenant(r.tenant, r.cache_salt or None)
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
            self.pool_port.release(seq.request_id, seq.grant)  # aborted while computing: no sender
            return
        room.seq = seq
        room.first_token = seq.token_ids[-1]
        self.transfer_stats.inc("prompt_tokens", seq.prompt_len)
        self.transfer_stats.inc("prefix_cached_tokens", seq.cached_tokens)
        self._feed(seq.request_id, p.Prefilled())

    # ---- the state machine ----------------------------------------------------------------------

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

    async def _send_pages(self, rid: str, room: _Room) -> None:
        assert room.seq is not None and room.first_token is not None
        started = self.transfer_stats.mark(rid, "send_start")
        n_tokens = room.seq.prompt_len  # what was computed (a placeholder's is shorter)
        view = self.pool_port.view
        # Decode holds the first `skip` pages in its own cache: they are never sent.
        skip = room.reserve.cached_tokens // view.page_size
        sent_tokens = n_tokens - skip * view.page_size
        late = self.faults.active("late_write")
        corrupt = self.faults.active("corrupt_page")  # decided once per room (chaos: per room)
        if self.faults.active("stall_transfer"):
            await asyncio.sleep(self.faults.stall_s)
            if (room.stop_sending and not late) or room.conn.closed:
                return
        src = room.seq.pages[skip:]
        if sent_tokens <= 0 or not self._source_is_sound(room.seq, skip, sent_tokens):
            self.transfer_stats.inc("source_integrity_errors")
            self._feed(rid, p.ComputeFailed("kv_integrity_error", "KV source check failed"))
            return
        self.transfer_stats.mark(rid, "source_checked")
        ranks = self.engine.cfg.tp_size  # each run carries every rank's slice
        runs = kvio.runs(view, sent_tokens, self.link.run_bytes // ranks)
        if self.faults.active("truncate_transfer"):
            sent_tokens = min(sent_tokens, view.page_size)
            runs, n_tokens = [(0, 1, sent_tokens)], skip * view.page_size + sent_tokens
        n_pages = skip + sum(n for _, n, _ in runs)

        def hold(fut: asyncio.Future) -> None:
            room.writing = fut

        def sent(n: int, count: int) -> None:
            if self.faults.active("kill_prefill"):
                self.faults.crash("kill_prefill")
            self.transfer_stats.inc("pages_sent", n)
            self.transfer_stats.inc("bytes_sent", n * ranks * kvio.payload_size(view, count))

        assert room.seq.grant is not None
        job = RoomSend(
            rid,
            room.conn,
            self.pool_port.pages(room.seq.grant),
            src,
            list(room.reserve.dst_pages),
            runs,
            sent_tokens,
            corrupt,
            cancelled=lambda: room.stop_sending,
            stopped=lambda: (room.stop_sending and not late) or room.conn.closed,
            hold=hold,
            sent=sent,
            slices=self.slices,
        )
        try:
            sums = await self.link.send_room(job)
        except ConnectionError:
            return  # the reader sees the close and feeds ConnectionLost
        except TpBroken as e:  # a rank was lost: the engine fails closed, the room with it
            log.error("sending room %s failed: %s", rid, e)
            self._feed(rid, p.ComputeFailed("engine_failed", "prefill lost a tensor-parallel rank"))
            return
        except Exception as e:  # a failed one-sided write: abort the room with the reason
            log.error("sending room %s failed: %s", rid, e)
            self._feed(rid, p.TimedOut())
            return
        if sums is None or room.stop_sending:
            return
        self.transfer_stats.mark(rid, "pages_sent")
        first_lp: dict = {}
        if room.seq.pending_logprobs:
            lp = room.seq.pending_logprobs[-1]
            first_lp = {"logprob": lp.logprob, "top": [list(t) for t in lp.top]}
        first_lp = attach(first_lp, room.seq.prompt_scores)  # decode answers with them
        first_lp = self.faults.hook("drop_prompt_logprobs", first_lp)
        digest = p.digest_of(tuple(sums), n_tokens)
        done = p.Done(
            rid,
            n_tokens,
            n_pages,
            digest,
            room.first_token,
            first_lp,
            cached_tokens=room.reserve.cached_tokens,
        )
        self.transfer_stats.inc("transfers_done")
        self.transfer_stats.inc(
            "bytes_not_transferred", skip * ranks * kvio.payload_size(view, view.page_size)
        )
        now = self.transfer_stats.mark(rid, "done_queued")
        self.transfer_stats.observe_phase("send", now - started)
        self.transfer_stats.observe_latency(now - room.started)
        self._feed(rid, p.SendComplete(done))

    def _source_is_sound(self, seq: Sequence, skip: int, n_tokens: int) -> bool:
        """I2 on the transfer source: every page sent (the room's pages from `skip` on, holding
        n_tokens) must be owned by the room's grant and hold data written under it, or be a
        sealed page of the room's namespace, with its key there, that the room references (one
        compare over the pages)."""
        if not self.faults.guards().on("tag_check") or seq.grant is None:
            return seq.grant is not None
        pages = seq.pages[skip:]
        port, grant = self.pool_port, seq.grant
        if not port.check_source(grant, pages, n_tokens, self._sealed_source(seq, skip)):
            log.error(
                "transfer source check failed: room=%s tenant=%s pages=%s %s",
                seq.request_id,
                seq.tenant,
                pages,
                port.describe_owners(grant, pages),
            )
            return False
        return True

    def _sealed_source(self, seq: Sequence, skip: int) -> SealedReads | None:
        """Which sealed pages the room may send: those its own chain keys, in its namespace."""
        if seq.chain is None:
            return None
        width = len(seq.pages) - skip
        tags = list(seq.chain.tags[skip : skip + width])
        tags += [0] * (width - len(tags))
        namespace = self.faults.guards().on("prefix_namespace")
        return self.pool_port.sealed_reads(seq.chain.tenant_ns, tags, namespace)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for rid, room in list(self.rooms.items()):
                if now > room.deadline:
                    log.warning("room %s timed out in %s", rid, room.state.state.value)
                    self._feed(rid, p.TimedOut())


class _RoomEffects:
    """What prefill's glue actions do to one room (glue.PrefillEffects), on the io loop. room is
    None for a room being opened or one prefill no longer holds."""

    def __init__(
        self, svc: PrefillService, rid: str, conn: Connection | None, room: _Room | None
    ) -> None:
        self.svc, self.rid, self.conn, self.room = svc, rid, conn, room

    def send(self, message: p.Message, fenced: bool) -> None:
        if self.conn is None:
            return
        if isinstance(message, p.Abort):
            self.svc.transfer_stats.inc("aborts_sent")
        writing = self.room.writing if fenced and self.room is not None else None
        asyncio.ensure_future(_send_after(writing, self.conn, message))

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
        asyncio.ensure_future(self.svc._send_pages(self.rid, self.room))


def _ignore(_: RequestOutput) -> None:
    """Prefill sequences have no HTTP client; their result travels as pages and DONE."""


async def _send_after(writing: asyncio.Future | None, conn: Connection, msg: wire.Frame) -> None:
    """Send msg once the room's in-flight write (if any) is over: an ABORT_ACK must never
    overtake a write it claims is finished (I4)."""
    if writing is not None:
        try:
            await writing
        except Exception:
            pass
    await _safe_send(conn, msg)


async def _safe_send(conn: Connection, msg: wire.Frame) -> None:
    try:
        await conn.send(msg)
    except ConnectionError:
        pass
