"""The world the explorer walks: one decode and one prefill worker, their page pools, the
connection between them and a fault-injecting environment, driving kvfence.pd.protocol's own
state machines (decode_step, prefill_open, prefill_step) and the real admission rule (admit).

The glue that turns actions into effects is the runtime's own too (kvfence.pd.glue); what is
written here is what each effect does to the world (the engine's commit / fail / release rules,
the receiver's writes, prefill's sending), see formal/README.md. Invariants I1-I5 and liveness
are predicates over the world, checked by the explorer in every reachable state.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from kvfence.engine import admission
from kvfence.engine.admission import AdmissionLimits, Admitted
from kvfence.engine.request import GenerateRequest, SamplingParams
from kvfence.pd import glue
from kvfence.pd import protocol as p

# The step functions the explorer drives: the very objects the runtime calls, never a copy.
decode_step = p.decode_step
prefill_open = p.prefill_open
prefill_step = p.prefill_step
admit = admission.admit
# The runtime's glue around them (which effect each action has), also the runtime's own.
decode_feed = glue.decode_feed
prefill_start = glue.prefill_start
prefill_feed = glue.prefill_feed

FAULTS = (
    "drop",  # a control message or tcp page frame vanishes (the connection stays up)
    "dup",  # a message is delivered twice (a replay; TCP alone never does this, see I8)
    "decode_timeout",
    "prefill_timeout",
    "decode_crash",
    "prefill_crash",
    "client_abort",
    "truncate",  # prefill sends only the first page and a DONE that agrees (a prefill bug)
    "corrupt",  # one page's bytes change on the way (checksums no longer match)
    # decode's prefix cache hands a request a page holding other KV (a key collision or a
    # namespace bug): its RESERVE claims a prefix that is not the request's
    "wrong_prefix",
)
# Faults after which a room may legitimately need a timeout to end: something was lost (or a
# replay orphaned a room).
LOSSY = frozenset(
    {"drop", "dup", "decode_timeout", "prefill_timeout", "decode_crash", "prefill_crash"}
)
# Guards that live outside protocol.Guards: the environment/runtime applies them.
MODEL_GUARDS = frozenset({"admission", "tag_check", "prefix_pin", "prefix_digest"})
ALL_GUARDS = p.GUARDS | MODEL_GUARDS

# Bugs this checker found in the runtime's glue (not in protocol.py). The model mirrors the
# runtime as it is unless a finding is named in Config.assume_fixed.
# Fixed so far: "ack_to_prefill" (prefill.py now ignores an ABORT_ACK of its own ABORT), and
# in the mooncake glue: source pages freed under a running one-sided write (now freed after
# it), the collision ABORT for a live room (now aborts the live room first, so it fences).
FINDINGS: dict[str, str] = {}

STALE = -1  # KV left in a page by an earlier request of another tenant (pages are never zeroed)
CORRUPT = -2
CACHE = -3  # owner of a sealed decode prefix-cache page (the pool's CACHE_OWNER)
PRIOR_TENANT = "Z"


@dataclass(frozen=True)
class ReqSpec:
    tenant: str
    n_tokens: int  # page_size is 1 token in the model, so also the page count
    # Leading pages decode's prefix cache holds for it at the start (an earlier turn of the
    # same tenant left them): decode references them, reserves only the rest, and prefill
    # sends only the rest.
    cached: int = 0


@dataclass(frozen=True)
class Config:
    name: str
    requests: tuple[ReqSpec, ...]
    decode_pages: int
    prefill_pages: int
    context_length: int
    faults: tuple[tuple[str, int], ...]
    transport: str = "tcp"  # tcp: pages ride the ordered stream; mooncake: one-sided writes
    fifo: bool = True  # per-connection order (and, for mooncake, the write fence) holds
    off: frozenset[str] = frozenset()  # guards removed: mutation twins
    placeholder: bool = False  # the incident's path: a rejected request continues as 1 token
    max_faults: int = 2  # faults per run, all kinds together (timeouts included)
    assume_fixed: frozenset[str] = frozenset()  # runtime findings (FINDINGS) modelled as fixed

    def budget(self) -> tuple[int, ...]:
        b = dict(self.faults)
        return tuple(b.get(k, 0) for k in FAULTS)


class Stage(enum.Enum):
    NEW = "new"  # the client has not sent it yet
    WAITING = "waiting"  # admitted at decode, waiting for free pages
    HANDOFF = "handoff"  # decode pages held, the transfer owns them
    RUNNING = "running"  # committed: decoding over its pages
    DONE = "done"  # the engine forgot it; pages returned


@dataclass(frozen=True)
class Req:
    stage: Stage = Stage.NEW
    # decode side
    droom: p.DecodeRoom | None = None
    dpages: tuple[int, ...] = ()  # the sequence's page table (the full prompt)
    dcached: tuple[int, ...] = ()  # its leading cache pages, referenced (pinned), not owned
    prefix_sums: tuple[int, ...] = ()  # their checksums when RESERVE went out
    client: tuple = ()  # () | ("ok",) | ("err", code, status): what the client was told
    abort_pending: bool = False  # the engine told the client; ClientAborted not yet fed
    # prefill side
    proom: p.PrefillRoom | None = None
    dst: tuple[int, ...] = ()  # decode pages named by the RESERVE prefill acts on
    skip: int = 0  # leading pages decode holds (RESERVE's cached count): never sent
    n_send: int = 0  # tokens (= pages) prefill computes and sends
    ppages: tuple[int, ...] = ()
    computed: bool = False
    psent: int = 0
    sums: tuple[tuple[int, int], ...] = ()
    stop: bool = False  # StopSending seen
    writing: bool = False  # mooncake: the one-sided writes were issued
    release_pending: bool = False  # mooncake: ReleasePages waits for this room's writes
    # safety records made by a transition (a read, a commit) and checked as invariants
    bad: tuple[tuple[str, str], ...] = ()


Msg = tuple  # (kind, room, fenced, *fields): small, hashable, readable in traces


@dataclass(frozen=True)
class World:
    reqs: tuple[Req, ...]
    dpool: tuple[tuple[int | None, int], ...]  # (owner request, data) per decode page
    ppool: tuple[tuple[int | None, int], ...]
    d2p: tuple[Msg, ...] = ()
    p2d: tuple[Msg, ...] = ()
    rdma: tuple[Msg, ...] = ()  # one-sided writes in flight (mooncake)
    pins: tuple[int, ...] = ()  # per decode page: references of live requests (cache pages)
    budget: tuple[int, ...] = ()
    spent: frozenset[str] = field(default_factory=frozenset)  # fault kinds used so far


def cks(data: int) -> int:
    """A page's checksum: the model's data identity (equal data, equal checksum)."""
    return 1000 + data


def data_of(r: int, i: int) -> int:
    return 10 * r + i


class Model:
    def __init__(self, cfg: Config) -> None:
        unknown = (cfg.off - ALL_GUARDS) | (cfg.assume_fixed - FINDINGS.keys())
        if unknown:
            raise ValueError(f"unknown guards or findings {sorted(unknown)}")
        self.cfg = cfg
        self.guards = p.Guards(frozenset(cfg.off & p.GUARDS))
        self.admission = "admission" not in cfg.off
        self.tag_check = "tag_check" not in cfg.off
        self.prefix_pin = "prefix_pin" not in cfg.off
        self.prefix_digest = "prefix_digest" not in cfg.off
        self.mooncake = cfg.transport == "mooncake"
        self.total_budget = sum(cfg.budget())
        limits = AdmissionLimits(cfg.context_length, cfg.decode_pages, vocab_size=100)
        plimits = AdmissionLimits(cfg.context_length, cfg.prefill_pages, vocab_size=100)
        self.dverdict = [admit(self._request(r), limits) for r in range(len(cfg.requests))]
        self.pverdict = [admit(self._request(r), plimits) for r in range(len(cfg.requests))]

    def _request(self, r: int) -> GenerateRequest:
        spec = self.cfg.requests[r]
        prompt = tuple(range(1, spec.n_tokens + 1))
        return GenerateRequest(f"r{r}", spec.tenant, prompt, SamplingParams(max_tokens=1))

    def rejected(self, r: int) -> bool:
        return not isinstance(self.dverdict[r], Admitted)

    # ---- the initial world -------------------------------------------------------------------

    def initial(self) -> World:
        c = self.cfg
        # Decode's prefix cache at the start: each request's cached prefix, sealed, in order.
        cached = [(CACHE, data_of(r, i)) for r, s in enumerate(c.requests) for i in range(s.cached)]
        return World(
            reqs=tuple(Req() for _ in c.requests),
            dpool=tuple(cached + [(None, STALE)] * (c.decode_pages - len(cached))),
            ppool=tuple((None, STALE) for _ in range(c.prefill_pages)),
            budget=c.budget(),
            pins=(0,) * c.decode_pages,
        )

    # ---- small helpers -----------------------------------------------------------------------

    @staticmethod
    def _set(w: World, r: int, **kw: object) -> World:
        reqs = list(w.reqs)
        reqs[r] = replace(reqs[r], **kw)
        return replace(w, reqs=tuple(reqs))

    @staticmethod
    def _spend(w: World, kind: str) -> World:
        b = list(w.budget)
        b[FAULTS.index(kind)] -= 1
        return replace(w, budget=tuple(b), spent=w.spent | {kind})

    def _can(self, w: World, kind: str) -> bool:
        used = self.total_budget - sum(w.budget)
        return w.budget[FAULTS.index(kind)] > 0 and used < self.cfg.max_faults

    @staticmethod
    def _bad(w: World, r: int, inv: str, text: str) -> World:
        return Model._set(w, r, bad=(*w.reqs[r].bad, (inv, text)))

    @staticmethod
    def _free_pages(pool: tuple[tuple[int | None, int], ...]) -> list[int]:
        return [i for i, (owner, _) in enumerate(pool) if owner is None]

    def _tell(self, w: World, r: int, answer: tuple) -> World:
        """The engine's emit: a request's final output reaches its client at most once."""
        if w.reqs[r].client:
            return w
        return self._set(w, r, client=answer)

    def _free_decode(self, w: World, r: int) -> World:
        pool = list(w.dpool)
        for pg in w.reqs[r].dpages:
            if pool[pg][0] == r:
                pool[pg] = (None, pool[pg][1])
        pins = list(w.pins)
        for pg in w.reqs[r].dcached:
            pins[pg] -= 1  # the reference goes; the page stays cached (evictable at 0)
        w = replace(w, dpool=tuple(pool), pins=tuple(pins))
        return self._set(w, r, dpages=(), dcached=())

    def _free_prefill(self, w: World, r: int) -> World:
        pool = list(w.ppool)
        for pg in w.reqs[r].ppages:
            if pool[pg][0] == r:
                pool[pg] = (None, pool[pg][1])
        return self._set(replace(w, ppool=tuple(pool)), r, ppages=())

    # ---- decode glue: decode.py _feed and the engine's commit / fail / release --------------

    def _decode_feed(self, w: World, r: int, event: object) -> World:
        """decode.py _feed: the runtime's own glue (decode_feed), with effects on the world."""
        fx = _DecodeWorld(self, w, r, event)
        room = decode_feed(f"r{r}", w.reqs[r].droom, event, self.guards, fx)
        return self._set(fx.w, r, droom=room)

    def _engine_commit(self, w: World, r: int, event: object) -> World:
        req = w.reqs[r]
        if req.stage is not Stage.HANDOFF:
            return w
        if req.client:
            # engine.py: the client left while the last pages were in flight; the transfer
            # is over, so the commit releases the sequence instead.
            w = self._free_decode(w, r)
            return self._set(w, r, stage=Stage.DONE)
        assert isinstance(event, p.DoneArrived)
        n_true = self.cfg.requests[r].n_tokens
        wrong = [(i, pg) for i, pg in enumerate(req.dpages) if w.dpool[pg][1] != data_of(r, i)]
        if event.done.n_tokens != n_true or wrong:
            what = ", ".join(f"page {pg} holds {describe(w.dpool[pg][1], self)}" for _, pg in wrong)
            w = self._bad(
                w,
                r,
                "I3",
                f"r{r} committed {event.done.n_tokens} of {n_true} tokens"
                + (f"; {what}" * bool(wrong)),
            )
        return self._set(w, r, stage=Stage.RUNNING)

    def _decode_read(self, w: World, r: int) -> World:
        """The runner decodes over the sequence's page table, then the request finishes."""
        req = w.reqs[r]
        if self.tag_check and any(not self._readable(w, r, pg) for pg in req.dpages):
            w = self._tell(w, r, ("err", "page_ownership", 500))
        else:
            wrong = False
            for i, pg in enumerate(req.dpages):
                data = w.dpool[pg][1]
                if data != data_of(r, i):
                    wrong = True
                    owner = w.dpool[pg][0]
                    who = owner_text(owner)
                    w = self._bad(
                        w,
                        r,
                        "I2",
                        f"decode of r{r} (tenant {self.cfg.requests[r].tenant}) read page {pg} "
                        f"({who}) holding {describe(data, self)}",
                    )
            if not w.reqs[r].client:
                if wrong:
                    w = self._bad(w, r, "I5", f"r{r}'s client got HTTP 200 with wrong content")
                if self.rejected(r):
                    w = self._bad(w, r, "I5", f"r{r}'s client got HTTP 200 for a rejected prompt")
            w = self._tell(w, r, ("ok",))
        w = self._free_decode(w, r)
        return self._set(w, r, stage=Stage.DONE)

    @staticmethod
    def _readable(w: World, r: int, pg: int) -> bool:
        """I2 as the pool checks it: a page r's grant owns, or a cache page r references."""
        owner = w.dpool[pg][0]
        return owner == r or (owner == CACHE and pg in w.reqs[r].dcached)

    # ---- prefill glue: prefill.py _on_reserve / _feed, prefill_send.py RoomSender.send -------

    def _prefill_reserve(self, w: World, r: int, msg: Msg) -> World:
        _, _, _, dst, n_tokens, skip, claim = msg
        req = w.reqs[r]
        if req.proom is not None and req.proom.state is not p.PState.CLOSED:
            # prefill.py: a second RESERVE of a live room aborts the live room, then answers
            # ABORT(room_collision) after its writes, so the answer fences decode's pages.
            collision = p.Abort(f"r{r}", "room_collision", "", 409)
            w = self._prefill_feed(w, r, p.AbortArrived(collision))
            return replace(w, p2d=(*w.p2d, ("ABORT", r, True, "room_collision", 409)))
        verdict = self.pverdict[r] if n_tokens == self.cfg.requests[r].n_tokens else None
        if verdict is None or isinstance(verdict, Admitted) or not self.admission:
            event = p.ReserveArrived(True)
        elif self.cfg.placeholder:
            event, n_tokens = p.ReserveArrived(True), 1  # the incident: swap in a placeholder
        else:
            event = p.ReserveArrived(False, verdict.code, verdict.message, 400)
        if self.prefix_digest and claim != tuple(data_of(r, i) for i in range(skip)):
            # prefill.py _prefix_problem: decode's cached prefix is not this room's prompt.
            event = p.ReserveArrived(False, "kv_prefix_mismatch", "", 500)
        fx = _PrefillWorld(self, w, r)
        room = prefill_start(f"r{r}", event, fx)
        w = fx.w
        if room.state is not p.PState.CLOSED:
            w = self._set(
                w,
                r,
                proom=room,
                dst=dst,
                skip=skip,
                n_send=n_tokens,
                ppages=(),
                computed=False,
                psent=0,
                sums=(),
                stop=False,
                writing=False,
            )
        return w

    def _prefill_feed(self, w: World, r: int, event: object) -> World:
        """prefill.py _feed: the runtime's own glue (prefill_feed), with effects on the world."""
        fx = _PrefillWorld(self, w, r)
        room = prefill_feed(f"r{r}", w.reqs[r].proom, event, self.guards, fx)
        return self._set(fx.w, r, proom=room)

    def _prefill_compute(self, w: World, r: int) -> World | None:
        req = w.reqs[r]
        free = self._free_pages(w.ppool)
        if len(free) < req.n_send:
            return None
        pages = tuple(free[: req.n_send])
        pool = list(w.ppool)
        for i, pg in enumerate(pages):
            pool[pg] = (r, data_of(r, i))
        w = self._set(replace(w, ppool=tuple(pool)), r, ppages=pages, computed=True)
        return self._prefill_feed(w, r, p.Prefilled())

    def _send_page(self, w: World, r: int, corrupt: bool) -> World:
        req = w.reqs[r]
        i = req.psent  # counted from the first page decode lacks
        data = w.ppool[req.ppages[req.skip + i]][1]
        msg = ("PAGE", r, True, i, req.dst[i], CORRUPT if corrupt else data, cks(data))
        w = replace(w, p2d=(*w.p2d, msg))
        return self._set(w, r, psent=i + 1, sums=(*req.sums, (i, cks(data))))

    def _send_writes(self, w: World, r: int, corrupt: bool) -> World:
        req = w.reqs[r]
        n = req.n_send - req.skip
        writes = tuple(
            ("WRITE", r, i, req.dst[i], req.ppages[req.skip + i], corrupt and i == 0)
            for i in range(n)
        )
        sums = tuple((i, cks(w.ppool[req.ppages[req.skip + i]][1])) for i in range(n))
        return self._set(replace(w, rdma=w.rdma + writes), r, writing=True, sums=sums)

    def _send_headers_and_done(self, w: World, r: int) -> World:
        req = w.reqs[r]
        headers = tuple(("PAGE", r, True, i, req.dst[i], None, c) for i, c in req.sums)
        w = self._set(replace(w, p2d=w.p2d + headers), r, psent=req.n_send - req.skip)
        return self._send_done(w, r)

    def _send_done(self, w: World, r: int) -> World:
        req = w.reqs[r]
        digest = p.digest_of(req.sums, req.n_send)
        done = p.Done(f"r{r}", req.n_send, req.n_send, digest, 0, cached_tokens=req.skip)
        return self._prefill_feed(w, r, p.SendComplete(done))

    # ---- deliveries --------------------------------------------------------------------------

    def _deliver_to_prefill(self, w: World, msg: Msg) -> World:
        kind, r = msg[0], msg[1]
        if kind == "RESERVE":
            return self._prefill_reserve(w, r, msg)
        if kind == "ABORT":
            return self._prefill_feed(w, r, p.AbortArrived(p.Abort(f"r{r}", msg[3], "", msg[4])))
        if kind == "DONE_ACK":
            return self._prefill_feed(w, r, p.DoneAckArrived())
        if kind == "ABORT_ACK":
            return w  # prefill.py: an ack of its own ABORT; that ABORT already fenced the room
        # prefill.py _on_message: any other frame is a WireError that drops the connection.
        return self._bad_frame(w, r, kind)

    def _bad_frame(self, w: World, r: int, kind: str) -> World:
        w = self._bad(w, r, "W", f"prefill cannot handle {kind} of r{r}: it drops the connection")
        return self._connection_lost(w)

    def _deliver_to_decode(self, w: World, msg: Msg) -> World:
        kind, r = msg[0], msg[1]
        room = w.reqs[r].droom
        open_ = room is not None and room.state is p.DState.RESERVED
        if kind == "PAGE":
            _, _, _, i, pg, data, checksum = msg
            owner_ok = w.dpool[pg][0] == r
            if self.mooncake:
                intact = owner_ok or not self.tag_check
            else:
                if self.tag_check and not open_:
                    return w  # decode.py: the tcp receiver refuses a write to a closed room
                intact = cks(data) == checksum or "checksum" in self.cfg.off
                if self.tag_check and not owner_ok:
                    intact = False
                if intact:
                    w = self._write(w, pg, data)
            if not open_:
                return w
            # decode.py feeds a frame's pages as one RunArrived; the model's frames hold one page.
            return self._decode_feed(w, r, p.RunArrived((p.PageArrived(i, 1, checksum, intact),)))
        if kind == "DONE":
            _, _, _, n_tokens, n_pages, digest, skipped = msg
            ok = open_ and self._pool_matches(w, r, n_tokens, n_pages, digest)
            done = p.Done(f"r{r}", n_tokens, n_pages, digest, 0, cached_tokens=skipped)
            return self._decode_feed(w, r, p.DoneArrived(done, ok))
        if kind == "ABORT":
            abort = p.Abort(f"r{r}", msg[3], "", msg[4])
            return self._decode_feed(w, r, p.AbortArrived(abort))
        if kind == "ABORT_ACK":
            return self._decode_feed(w, r, p.AbortAckArrived())
        raise AssertionError(kind)

    def _pool_matches(self, w: World, r: int, n_tokens: int, n_pages: int, digest: int) -> bool:
        """decode.py _pool_matches: read the room's pages back and hash them. Its count
        precondition belongs to the count_check guard here, so that twin removes every count
        comparison; without it the read-back reads the pages prefill declared."""
        req = w.reqs[r]
        assert req.droom is not None
        k = req.droom.cached_pages
        xfer = req.dpages[: req.droom.n_pages]
        if self.guards.on("count_check"):
            if n_tokens != req.droom.n_tokens or n_pages != len(xfer):
                return False
        elif n_pages > len(xfer):
            return False
        # The cached prefix too: unchanged since RESERVE (the read-back covers every page).
        if tuple(cks(w.dpool[pg][1]) for pg in xfer[:k]) != req.prefix_sums:
            return False
        sums = tuple((i, cks(w.dpool[xfer[k + i]][1])) for i in range(n_pages - k))
        return p.digest_of(sums, n_tokens) == digest

    @staticmethod
    def _write(w: World, pg: int, data: int) -> World:
        pool = list(w.dpool)
        pool[pg] = (pool[pg][0], data)
        return replace(w, dpool=tuple(pool))

    # ---- connection loss and crashes ---------------------------------------------------------

    def _connection_lost(self, w: World, keep_rdma: bool = True) -> World:
        """Both readers stop: every open room on the connection hears ConnectionLost. In-flight
        tcp frames die with it; one-sided writes do not (closing a socket fences no RDMA)."""
        w = replace(w, d2p=(), p2d=(), rdma=w.rdma if keep_rdma else ())
        for r in range(len(w.reqs)):
            room = w.reqs[r].droom
            if room is not None and room.state in (p.DState.RESERVED, p.DState.ABORTING):
                w = self._decode_feed(w, r, p.ConnectionLost())
            proom = w.reqs[r].proom
            if proom is not None and proom.state is not p.PState.CLOSED:
                w = self._prefill_feed(w, r, p.ConnectionLost())
            if w.reqs[r].release_pending and not any(m[1] == r for m in w.rdma):
                w = self._set(self._free_prefill(w, r), r, release_pending=False)
        return replace(w, d2p=(), p2d=())  # what the rooms sent went into a closed socket

    def _decode_crash(self, w: World) -> World:
        for r, req in enumerate(w.reqs):
            if req.stage in (Stage.WAITING, Stage.HANDOFF, Stage.RUNNING):
                w = self._tell(w, r, ("err", "decode_crashed", 502))
                w = self._set(w, r, stage=Stage.DONE, droom=None, dpages=(), abort_pending=False)
        w = replace(w, dpool=tuple((None, data) for _, data in w.dpool))
        w = replace(w, pins=(0,) * len(w.pins))  # the prefix cache died with the process
        for r in range(len(w.reqs)):
            w = self._set(w, r, dcached=())
        # The registered memory died with the process: in-flight one-sided writes go nowhere.
        return self._connection_lost(w, keep_rdma=False)

    def _prefill_crash(self, w: World) -> World:
        for r in range(len(w.reqs)):
            w = self._set(w, r, proom=None, ppages=(), stop=False, writing=False)
        w = replace(w, ppool=tuple((None, data) for _, data in w.ppool))
        return self._connection_lost(w, keep_rdma=False)

    # ---- the transition relation --------------------------------------------------------------

    def successors(self, w: World) -> Iterator[tuple[str, str, World]]:
        """(label, kind, next world); kind is "env" (a fault-free step), "timeout" or "fault"."""
        for r, req in enumerate(w.reqs):
            yield from self._request_moves(w, r, req)
        yield from self._deliveries(w)
        yield from self._evictions(w)
        if self._can(w, "decode_crash"):
            yield (
                "decode crashes and restarts",
                "fault",
                self._decode_crash(self._spend(w, "decode_crash")),
            )
        if self._can(w, "prefill_crash"):
            yield (
                "prefill crashes and restarts",
                "fault",
                self._prefill_crash(self._spend(w, "prefill_crash")),
            )

    def _evictions(self, w: World) -> Iterator[tuple[str, str, World]]:
        """Decode's cache evicts an unreferenced page (LRU on allocation, or the ttl), any time;
        without prefix_pin, a page a live request references too (the twin)."""
        for pg, (owner, data) in enumerate(w.dpool):
            if owner == CACHE and (w.pins[pg] == 0 or not self.prefix_pin):
                pool = list(w.dpool)
                pool[pg] = (None, data)
                yield f"decode evicts cached page {pg}", "env", replace(w, dpool=tuple(pool))

    def _request_moves(self, w: World, r: int, req: Req) -> Iterator[tuple[str, str, World]]:
        spec = self.cfg.requests[r]
        if req.stage is Stage.NEW:
            verdict = self.dverdict[r]
            if isinstance(verdict, Admitted) or not self.admission or self.cfg.placeholder:
                yield (
                    f"r{r} (tenant {spec.tenant}, {spec.n_tokens} tokens) admitted at decode",
                    ("env"),
                    self._set(w, r, stage=Stage.WAITING),
                )
            else:
                nw = self._tell(w, r, ("err", verdict.code, 400))
                yield (
                    f"r{r} rejected at decode: {verdict.code} (400)",
                    "env",
                    self._set(nw, r, stage=Stage.DONE),
                )
        elif req.stage is Stage.WAITING:
            free = self._free_pages(w.dpool)
            hit = self._cache_hit(w, r)
            if len(free) >= spec.n_tokens - len(hit):
                new = tuple(free[: spec.n_tokens - len(hit)])
                yield self._allocate(w, r, hit, new)
                if hit and self._can(w, "wrong_prefix"):
                    # The cache's match hands r a page that holds other KV.
                    bad = self._write(self._spend(w, "wrong_prefix"), hit[0], STALE)
                    label, kind, nw = self._allocate(bad, r, hit, new)
                    yield label + " (its cached page holds other KV)", "fault", nw
        elif req.stage is Stage.RUNNING:
            yield (
                f"decode runs r{r} over pages {list(req.dpages)} and answers",
                "env",
                (self._decode_read(w, r)),
            )
        if req.abort_pending:
            yield (
                f"decode feeds ClientAborted to r{r}",
                "env",
                self._decode_feed(self._set(w, r, abort_pending=False), r, p.ClientAborted()),
            )
        if (
            self._can(w, "client_abort")
            and not req.client
            and req.stage in (Stage.WAITING, Stage.HANDOFF, Stage.RUNNING)
        ):
            nw = self._tell(self._spend(w, "client_abort"), r, ("err", "request_aborted", 499))
            if req.stage is Stage.HANDOFF:
                # engine._abort: the client hears now; the transfer hears on the io loop, later.
                nw = self._set(nw, r, abort_pending=True)
            else:
                nw = self._set(self._free_decode(nw, r), r, stage=Stage.DONE)
            yield f"r{r}'s client goes away", "fault", nw
        room = req.droom
        if room is not None and self._can(w, "decode_timeout"):
            nw = self._spend(w, "decode_timeout")
            if room.state is p.DState.RESERVED:
                yield f"decode times r{r} out", "timeout", self._decode_feed(nw, r, p.TimedOut())
            elif room.state is p.DState.ABORTING:
                yield (
                    f"decode times r{r} out again: closes the connection",
                    "timeout",
                    (self._connection_lost(nw)),
                )
        yield from self._prefill_moves(w, r, req)

    def _cache_hit(self, w: World, r: int) -> tuple[int, ...]:
        """The cache pages that start r's prompt (scheduler._lookup): its prefix's pages, while
        they are still cached."""
        hit: list[int] = []
        for i in range(self.cfg.requests[r].cached):
            pg = next(
                (g for g, (o, d) in enumerate(w.dpool) if o == CACHE and d == data_of(r, i)), None
            )
            if pg is None:
                break
            hit.append(pg)
        return tuple(hit)

    def _allocate(
        self, w: World, r: int, hit: tuple[int, ...], new: tuple[int, ...]
    ) -> tuple[str, str, World]:
        pool = list(w.dpool)
        for pg in new:
            pool[pg] = (r, pool[pg][1])
        pins = list(w.pins)
        for pg in hit:
            pins[pg] += 1
        pages = hit + new
        k = len(hit)
        n = self.cfg.requests[r].n_tokens
        if self.cfg.placeholder and self.rejected(r):
            n = 1  # the transfer carries the placeholder; the page table spans the prompt
        room = p.DecodeRoom(f"r{r}", n, n, cached_pages=k, cached_tokens=k)
        claim = tuple(w.dpool[pg][1] for pg in hit)  # what decode's cached pages hold
        w = self._set(
            replace(w, dpool=tuple(pool), pins=tuple(pins)),
            r,
            stage=Stage.HANDOFF,
            droom=room,
            dpages=pages,
            dcached=hit,
            prefix_sums=tuple(cks(d) for d in claim),
        )
        if self.rejected(r) and self.admission:
            w = self._bad(
                w, r, "I1", f"r{r} was rejected by admission but holds pages {list(pages)}"
            )
        w = replace(w, d2p=(*w.d2p, ("RESERVE", r, False, pages[k:n], n, k, claim)))
        return f"decode allocates pages {list(pages)} to r{r}, sends RESERVE", "env", w

    def _prefill_moves(self, w: World, r: int, req: Req) -> Iterator[tuple[str, str, World]]:
        room = req.proom
        if room is None or room.state is p.PState.CLOSED:
            return
        if room.state is p.PState.COMPUTING and not req.computed:
            nw = self._prefill_compute(w, r)
            if nw is not None:
                yield f"prefill computes r{r} into its pages, starts sending", "env", nw
        if room.state is p.PState.SENDING and not req.stop:
            yield from self._sending_moves(w, r, req)
        if self._can(w, "prefill_timeout"):
            yield (
                f"prefill times r{r} out",
                "timeout",
                self._prefill_feed(self._spend(w, "prefill_timeout"), r, p.TimedOut()),
            )

    def _sending_moves(self, w: World, r: int, req: Req) -> Iterator[tuple[str, str, World]]:
        n_sent = req.n_send - req.skip
        if req.psent == 0 and not req.writing and n_sent > 1 and self._can(w, "truncate"):
            yield (
                f"prefill truncates r{r} to its first page",
                "fault",
                self._set(self._spend(w, "truncate"), r, n_send=req.skip + 1),
            )
        if self.mooncake:
            if not req.writing:
                yield (
                    f"prefill issues r{r}'s one-sided writes",
                    "env",
                    self._send_writes(w, r, False),
                )
                if self._can(w, "corrupt"):
                    yield (
                        f"prefill issues r{r}'s writes, one corrupted",
                        "fault",
                        (self._send_writes(self._spend(w, "corrupt"), r, True)),
                    )
            elif not any(m[1] == r for m in w.rdma):
                yield (
                    f"r{r}'s writes completed: prefill sends headers and DONE",
                    "env",
                    (self._send_headers_and_done(w, r)),
                )
            return
        if req.psent < n_sent:
            yield f"prefill sends page {req.psent} of r{r}", "env", self._send_page(w, r, False)
            if self._can(w, "corrupt"):
                yield (
                    f"prefill sends page {req.psent} of r{r}, corrupted on the way",
                    "fault",
                    (self._send_page(self._spend(w, "corrupt"), r, True)),
                )
        else:
            yield f"prefill sends DONE for r{r}", "env", self._send_done(w, r)

    def _deliverable(self, chan: tuple[Msg, ...], rdma: tuple[Msg, ...]) -> Iterator[int]:
        """Indices of messages that may arrive next: the first of each room (per-connection
        order; rooms are independent), and for mooncake a fenced message only once the room's
        writes have landed. Without fifo, any message, any time."""
        if not self.cfg.fifo:
            yield from range(len(chan))
            return
        seen: set[int] = set()
        for k, m in enumerate(chan):
            if m[1] in seen:
                continue
            seen.add(m[1])
            if self.mooncake and m[2] and any(x[1] == m[1] for x in rdma):
                continue
            yield k

    def _deliveries(self, w: World) -> Iterator[tuple[str, str, World]]:
        for name, chan, to_prefill in (("d2p", w.d2p, True), ("p2d", w.p2d, False)):
            for k in self._deliverable(chan, w.rdma):
                msg = chan[k]
                rest = chan[:k] + chan[k + 1 :]
                nw = replace(w, **{name: rest})
                side = "prefill" if to_prefill else "decode"
                text = show_msg(msg)
                if to_prefill:
                    yield f"{side} receives {text}", "env", self._deliver_to_prefill(nw, msg)
                else:
                    yield f"{side} receives {text}", "env", self._deliver_to_decode(nw, msg)
                if self._can(w, "drop"):
                    yield f"{text} is lost on the way to {side}", "fault", self._spend(nw, "drop")
                if self._can(w, "dup"):
                    dup = replace(self._spend(w, "dup"), **{name: (*chan, msg)})
                    yield f"{text} is duplicated (a replay) to {side}", "fault", dup
        for k, m in enumerate(w.rdma):
            _, r, i, pg, src, corrupt = m
            data = CORRUPT if corrupt else w.ppool[src][1]
            nw = replace(w, rdma=w.rdma[:k] + w.rdma[k + 1 :])
            nw = self._write(nw, pg, data)
            if nw.reqs[r].release_pending and not any(x[1] == r for x in nw.rdma):
                nw = self._set(self._free_prefill(nw, r), r, release_pending=False)
            yield (
                (
                    f"one-sided write of r{r} page {i} lands in decode page {pg} "
                    f"(reads prefill page {src}: {describe(data, self)})"
                ),
                "env",
                nw,
            )

    # ---- invariants ----------------------------------------------------------------------------

    def violations(self, w: World) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for r, req in enumerate(w.reqs):
            out.extend(req.bad)
            if self.rejected(r):
                if req.ppages or (req.proom is not None and req.proom.state is not p.PState.CLOSED):
                    out.append(("I1", f"rejected r{r} holds a prefill room or pages"))
            if req.stage in (Stage.HANDOFF, Stage.RUNNING):
                if any(not self._readable(w, r, pg) for pg in req.dpages):
                    out.append(("I2", f"r{r}'s page table names a page it does not own"))
                for pg in req.dcached:
                    if w.dpool[pg][0] != CACHE:
                        out.append(("I4", f"cached page {pg}, pinned by r{r}, was evicted"))
            if req.stage is Stage.DONE and not req.client:
                out.append(("I5", f"r{r} ended without telling its client"))
        out.extend(self._i4(w))
        return out

    def _i4(self, w: World) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for k in (m for m in w.rdma):
            _, r, i, pg, src, _ = k
            if w.dpool[pg][0] != r:
                out.append(
                    (
                        "I4",
                        f"decode page {pg} is {owner_text(w.dpool[pg][0])} while a "
                        f"one-sided write of r{r} can still land in it",
                    )
                )
            if w.ppool[src][0] != r:
                out.append(
                    (
                        "I4",
                        f"prefill page {src} is {owner_text(w.ppool[src][0])} while a "
                        f"one-sided write of r{r} still reads it",
                    )
                )
        lands_anyway = self.mooncake or not self.tag_check
        if lands_anyway:
            for m in w.p2d:
                if m[0] == "PAGE" and not self.mooncake and w.dpool[m[4]][0] != m[1]:
                    out.append(
                        (
                            "I4",
                            f"decode page {m[4]} is {owner_text(w.dpool[m[4]][0])} "
                            f"while a page frame of r{m[1]} that will be applied "
                            "is in flight",
                        )
                    )
            for r, req in enumerate(w.reqs):
                room = req.proom
                if (
                    room is None
                    or req.stop
                    or room.state not in (p.PState.COMPUTING, p.PState.SENDING)
                ):
                    continue
                future = req.dst[req.psent :] if not req.writing else ()
                for pg in future:
                    if w.dpool[pg][0] != r:
                        out.append(
                            (
                                "I4",
                                f"decode page {pg} is {owner_text(w.dpool[pg][0])} "
                                f"while prefill will still write r{r} into it",
                            )
                        )
        return out

    def quiescent(self, w: World) -> bool:
        return (
            all(req.stage is Stage.DONE and req.client for req in w.reqs)
            and all(req.proom is None or req.proom.state is p.PState.CLOSED for req in w.reqs)
            and all(owner is None or owner == CACHE for owner, _ in w.dpool)
            and not any(w.pins)
            and all(owner is None for owner, _ in w.ppool)
            and not (w.d2p or w.p2d or w.rdma)
        )

    def can_time_out(self, w: World) -> bool:
        """A timeout that would fire in real time, whatever the fault budget says."""
        for req in w.reqs:
            if req.droom is not None and req.droom.state in (p.DState.RESERVED, p.DState.ABORTING):
                return True
            if req.proom is not None and req.proom.state is not p.PState.CLOSED:
                return True
        return False

    def lost_nothing(self, w: World) -> bool:
        return not (w.spent & LOSSY)



class _DecodeWorld:
    """glue.DecodeEffects on the model's world: what decode.py's effects do, as the world sees
    them (the engine's commit / fail / release rules; sends go on the decode -> prefill
    channel). w is the world as the effects so far left it."""

    def __init__(self, model: Model, w: World, r: int, event: object) -> None:
        self.model, self.w, self.r, self.event = model, w, r, event

    def send(self, message: p.Message) -> None:
        self.w = replace(self.w, d2p=(*self.w.d2p, _to_msg(self.r, message, fenced=False)))

    def commit(self, first_token: int, first_logprobs: dict) -> None:
        self.w = self.model._engine_commit(self.w, self.r, self.event)

    def fail_client(self, code: str, message: str, status: int) -> None:
        if self.w.reqs[self.r].stage is not Stage.DONE:
            self.w = self.model._tell(self.w, self.r, ("err", code, status))

    def release(self) -> None:
        m, r = self.model, self.r
        if self.w.reqs[r].stage is Stage.HANDOFF:  # engine.py: release ends a HANDOFF seq
            w = m._free_decode(self.w, r)
            w = m._tell(w, r, ("err", "aborted", 499))
            self.w = m._set(w, r, stage=Stage.DONE)


class _PrefillWorld:
    """glue.PrefillEffects on the model's world: sends go on the prefill -> decode channel
    (fenced ones wait for the room's one-sided writes, see _deliverable); a compute cancelled
    or a room released frees its prefill pages, after its one-sided writes (mooncake). The
    sending itself is the model's own moves (_sending_moves), enabled while the room is
    SENDING and not stopped."""

    def __init__(self, model: Model, w: World, r: int) -> None:
        self.model, self.w, self.r = model, w, r

    def send(self, message: p.Message, fenced: bool) -> None:
        self.w = replace(self.w, p2d=(*self.w.p2d, _to_msg(self.r, message, fenced)))

    def cancel_compute(self) -> None:
        self.release()  # the engine frees what the compute wrote, as a release does

    def release(self) -> None:
        m, r = self.model, self.r
        if m.mooncake and any(x[1] == r for x in self.w.rdma):
            self.w = m._set(self.w, r, release_pending=True)  # prefill.py: after the write
        else:
            self.w = m._free_prefill(self.w, r)

    def stop_sending(self) -> None:
        self.w = self.model._set(self.w, self.r, stop=True)

    def send_pages(self) -> None:
        pass  # the model's sending moves start once the room is SENDING

def _to_msg(r: int, m: p.Message, fenced: bool) -> Msg:
    if isinstance(m, p.Done):
        return ("DONE", r, fenced, m.n_tokens, m.n_pages, m.digest, m.cached_tokens)
    if isinstance(m, p.Abort):
        return ("ABORT", r, fenced, m.code, m.status)
    if isinstance(m, p.AbortAck):
        return ("ABORT_ACK", r, fenced)
    if isinstance(m, p.DoneAck):
        return ("DONE_ACK", r, fenced)
    raise AssertionError(f"the model does not carry {m!r}")


def owner_text(owner: int | None) -> str:
    if owner == CACHE:
        return "a cached page"
    return "free" if owner is None else f"owned by r{owner}"


def describe(data: int | None, model: Model) -> str:
    if data is None:
        return "?"
    if data == STALE:
        return f"stale KV of an earlier request (tenant {PRIOR_TENANT})"
    if data == CORRUPT:
        return "corrupted bytes"
    r, i = divmod(data, 10)
    return f"KV of r{r} page {i} (tenant {model.cfg.requests[r].tenant})"


def show_msg(m: Msg) -> str:
    kind, r = m[0], m[1]
    if kind == "RESERVE":
        return f"RESERVE(r{r}, {m[4]} tokens, {m[5]} cached, dst_pages={list(m[3])})"
    if kind == "PAGE":
        return f"PAGE(r{r}, index {m[3]} -> decode page {m[4]})"
    if kind == "DONE":
        return f"DONE(r{r}, {m[3]} tokens, {m[4]} pages)"
    if kind == "ABORT":
        return f"ABORT(r{r}, {m[3]}, {m[4]})"
    return f"{kind}(r{r})"
