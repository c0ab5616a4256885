"""Prefill's sending side, on the IO loop (and the transport's gather thread): one room's pages
that decode lacks, after the source check (I2: every page sent is the room's, or a sealed page of
its namespace it references), as PageRun frames with per-page checksums, then the DONE the room
table sends (counts, digest, first token). Every pool access goes through the pool port.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvfence.engine.prompt_logprobs import attach
from kvfence.engine.sequence import Sequence
from kvfence.engine.tp_group import TpBroken
from kvfence.faults import Faults
from kvfence.kv.pool import SealedReads
from kvfence.pd import kvio
from kvfence.pd import protocol as p
from kvfence.pd.pool_port import PoolPort, PortRuleBroken
from kvfence.pd.stats import TransferStats
from kvfence.pd.transport.page_link import PageSender, RoomSend
from kvfence.pd.transport.tcp import Connection

log = logging.getLogger("kvfence.pd.prefill")


@dataclass
class Room:
    """What prefill's room table keeps of a room beside its protocol state."""

    state: p.PrefillRoom
    conn: Connection
    reserve: p.Reserve
    deadline: float
    started: float
    stop_sending: bool = False
    seq: Sequence | None = None
    first_token: int | None = None
    writing: asyncio.Future | None = None  # reads of the room's pages still under way


class RoomSender:
    """feed(rid, event): an event for the room table (SendComplete with the DONE, or why the
    room failed)."""

    def __init__(
        self,
        port: PoolPort,
        link: PageSender,
        faults: Faults,
        stats: TransferStats,
        ranks: int,
        feed: Callable[[str, Any], None],
    ) -> None:
        self.port, self.link, self.faults, self.stats = port, link, faults, stats
        self.ranks = ranks  # each run carries every rank's slice
        self.feed = feed

    async def send(self, rid: str, room: Room) -> None:
        try:
            await self._send(rid, room)
        except PortRuleBroken as e:  # a bug of this service: the room fails closed
            self.stats.inc("port_rule_broken")
            log.error("sending room %s: %s", rid, e)
            self.feed(rid, p.ComputeFailed("kv_integrity_error", "KV source check failed"))

    async def _send(self, rid: str, room: Room) -> None:
        assert room.seq is not None and room.first_token is not None
        assert room.seq.grant is not None
        started = self.stats.mark(rid, "send_start")
        n_tokens = room.seq.prompt_len  # what was computed (a placeholder's is shorter)
        view, ranks = self.port.view, self.ranks
        # Decode holds the first `skip` pages in its own cache: they are never sent.
        skip = room.reserve.cached_tokens // view.page_size
        sent_tokens = n_tokens - skip * view.page_size
        late = self.faults.hook("late_write", False)  # decided once per room (chaos: per room)
        corrupt = self.faults.hook("corrupt_page", False)
        stall = self.faults.hook("stall_transfer", 0.0)
        if stall:  # a window for kills and aborts before the first page
            await asyncio.sleep(stall)
            if (room.stop_sending and not late) or room.conn.closed:
                return
        src = room.seq.pages[skip:]
        if sent_tokens <= 0 or not self._source_is_sound(room.seq, skip, sent_tokens):
            self.stats.inc("source_integrity_errors")
            self.feed(rid, p.ComputeFailed("kv_integrity_error", "KV source check failed"))
            return
        self.stats.mark(rid, "source_checked")
        runs = kvio.runs(view, sent_tokens, self.link.run_bytes // ranks)
        runs, n_tokens, sent_tokens = self.faults.hook(
            "truncate_transfer", (runs, n_tokens, sent_tokens), page_size=view.page_size, skip=skip
        )
        n_pages = skip + sum(n for _, n, _ in runs)

        def hold(fut: asyncio.Future) -> None:
            room.writing = fut

        def sent(n: int, count: int) -> None:
            self.faults.hook("kill_prefill")
            self.stats.inc("pages_sent", n)
            self.stats.inc("bytes_sent", n * ranks * kvio.payload_size(view, count))

        job = RoomSend(
            rid,
            room.conn,
            self.port.pages(room.seq.grant),
            src,
            list(room.reserve.dst_pages),
            runs,
            sent_tokens,
            corrupt,
            cancelled=lambda: room.stop_sending,
            stopped=lambda: (room.stop_sending and not late) or room.conn.closed,
            hold=hold,
            sent=sent,
            slices=self.port.slices,
        )
        try:
            sums = await self.link.send_room(job)
        except ConnectionError:
            return  # the reader sees the close and feeds ConnectionLost
        except TpBroken as e:  # a rank was lost: the engine fails closed, the room with it
            log.error("sending room %s failed: %s", rid, e)
            self.feed(rid, p.ComputeFailed("engine_failed", "prefill lost a tensor-parallel rank"))
            return
        except Exception as e:  # a failed one-sided write: abort the room with the reason
            log.error("sending room %s failed: %s", rid, e)
            self.feed(rid, p.TimedOut())
            return
        if sums is None or room.stop_sending:
            return
        self.stats.mark(rid, "pages_sent")
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
            lora_digest=room.seq.lora.digest if room.seq.lora is not None else "",
        )
        self.stats.inc("transfers_done")
        self.stats.inc(
            "bytes_not_transferred", skip * ranks * kvio.payload_size(view, view.page_size)
        )
        now = self.stats.mark(rid, "done_queued")
        self.stats.observe_phase("send", now - started)
        self.stats.observe_latency(now - room.started)
        self.feed(rid, p.SendComplete(done))

    def _source_is_sound(self, seq: Sequence, skip: int, n_tokens: int) -> bool:
        """I2 on the transfer source: every page sent (the room's pages from `skip` on, holding
        n_tokens) must be owned by the room's grant and hold data written under it, or be a
        sealed page of the room's namespace, with its key there, that the room references (one
        compare over the pages)."""
        if not self.faults.guards().on("tag_check") or seq.grant is None:
            return seq.grant is not None
        pages = seq.pages[skip:]
        port, grant = self.port, seq.grant
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
        return self.port.sealed_reads(seq.chain.tenant_ns, tags, namespace)
