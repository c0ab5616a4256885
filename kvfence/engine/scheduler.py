"""Scheduler: continuous batching with chunked prefill, FIFO entry to the pool, and preemption
by recompute (newest first) when a running sequence needs a page and none is free."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from kvfence.engine.sequence import SeqMode, SeqStatus, Sequence
from kvfence.kv.pool import KVPool, OwnershipError

log = logging.getLogger("kvfence.engine")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index computed this step
    length: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the step samples the next one."""
        return self.start + self.length == len(self.seq.token_ids)


@dataclass
class SchedulerLimits:
    chunked_prefill_size: int
    max_running_requests: int
    decode_step_prefill_budget: int  # the prefill budget of a step that also decodes


class Scheduler:
    def __init__(self, pool: KVPool, limits: SchedulerLimits) -> None:
        self.pool = pool
        self.limits = limits
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.handoff: dict[str, Sequence] = {}  # pages held for a KV transfer
        self.reserved: list[Sequence] = []  # DECODE_ONLY entries given pages this step
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def hold(self, seq: Sequence) -> None:
        """Running -> handoff: its pages now belong to a transfer, not to the step loop."""
        self.running.remove(seq)
        seq.status = SeqStatus.HANDOFF
        self.handoff[seq.request_id] = seq

    def resume(self, seq: Sequence) -> None:
        """Handoff -> running, after the transfer committed its KV."""
        del self.handoff[seq.request_id]
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence, pages_suspect: bool = False) -> None:
        """Take seq out of the queues and return its pages (it is finished or aborted). When its
        page list is suspect, free by grant from the side tables instead of trusting the list."""
        if seq.status in (SeqStatus.RUNNING, SeqStatus.HANDOFF):
            if seq.status is SeqStatus.RUNNING:
                self.running.remove(seq)
            else:
                del self.handoff[seq.request_id]
            if pages_suspect:
                assert seq.grant is not None
                self.pool.free_grant(seq.grant)
                seq.pages, seq.grant = [], None
            else:
                self._release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        preempted_before = self.num_preemptions
        decoding = [s for s in self.running if s.in_decode]
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted by an earlier sequence in this loop
            if self._ensure_slot(seq):
                chunks.append(ScheduledChunk(seq, seq.num_computed, 1))
        budget = self.limits.chunked_prefill_size
        if chunks:  # decodes share this step: a smaller prefill keeps their stall short
            budget = min(budget, self.limits.decode_step_prefill_budget)
        for seq in self.running:
            if budget == 0:
                break
            if not seq.in_decode and seq.status is SeqStatus.RUNNING:
                n = min(seq.num_uncomputed, budget)
                chunks.append(ScheduledChunk(seq, seq.num_computed, n))
                budget -= n
        # After a preemption the pool is short: admitting now would only thrash.
        may_admit = self.num_preemptions == preempted_before
        while (
            may_admit
            and budget > 0
            and self.waiting
            and len(self.running) < self.limits.max_running_requests
        ):
            seq = self.waiting[0]
            needed = self.pool.pages_for(len(seq.token_ids))
            if needed > self.pool.num_free:
                break  # FIFO: later arrivals never overtake the head of the queue
            self.waiting.popleft()
            seq.grant = self.pool.new_grant(seq.tenant, seq.request_id)
            seq.pages = self.pool.allocate(seq.grant, needed)
            if seq.mode is SeqMode.DECODE_ONLY and not seq.output_ids:
                # Pre-allocated for the whole prompt; its KV arrives by transfer, not compute.
                seq.status = SeqStatus.HANDOFF
                self.handoff[seq.request_id] = seq
                self.reserved.append(seq)
                continue
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            chunks.append(ScheduledChunk(seq, seq.num_computed, n))
            budget -= n
        return chunks

    def _ensure_slot(self, seq: Sequence) -> bool:
        """Make sure seq has a page for its next token, preempting newer sequences if needed.
        False when seq itself had to be preempted."""
        if seq.num_computed < len(seq.pages) * self.pool.page_size:
            return True
        while self.pool.num_free == 0:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        assert seq.grant is not None
        seq.pages.extend(self.pool.allocate(seq.grant, 1))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        assert seq.grant is not None
        try:
            self.pool.free(seq.grant, seq.pages)
        except OwnershipError:
            # The page list is corrupt (a bug elsewhere): free what the grant really owns, so
            # the pool stays sound and no foreign page is handed out twice.
            log.error(
                "request %s: page list not owned by its grant; freeing by grant", seq.request_id
            )
            self.pool.free_grant(seq.grant)
        seq.pages = []
        seq.grant = None
