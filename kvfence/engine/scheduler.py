"""Scheduler: continuous batching with chunked prefill, fair entry to the pool (engine/fairness.py:
FIFO within a tenant, the tenant holding the fewest slots first), and preemption by recompute
(newest first) when a running sequence needs a page and none is free. With the prefix cache, a
sequence enters holding the cached pages that start its tokens and computes only the rest; its
full pages are sealed into the cache as they fill. How many prefill tokens a step
that also decodes may carry is the step-time budget's call (kvfence/engine/step_budget.py)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvfence.engine.deadlines import tpot_lost, tpot_slack_ms
from kvfence.engine.entry import by_transfer as _by_transfer
from kvfence.engine.entry import entry_order
from kvfence.engine.entry import ms_left as _ms_left
from kvfence.engine.fairness import next_waiting
from kvfence.engine.fill import Fill
from kvfence.engine.prompt_logprobs import NO_SCORES, scored_range
from kvfence.engine.sequence import SeqMode, SeqStatus, Sequence
from kvfence.engine.step_budget import BudgetPolicy, Deadlines, StepBudget, StepCost
from kvfence.engine.waves import Wave, cut, cut_order, cut_release, mode
from kvfence.faults import Faults
from kvfence.kv.pool import KVPool, OwnershipError
from kvfence.kv.prefix import Namespace, lora_identity

if TYPE_CHECKING:
    from kvfence.lora.checkpoint import LoraAdapter

log = logging.getLogger("kvfence.engine")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first token index computed this step
    length: int  # tokens computed this step
    # Positions [lo, hi) whose logits score the prompt token after them (prompt logprobs).
    scored: tuple[int, int] = NO_SCORES

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so the step samples the next one."""
        return self.start + self.length == len(self.seq.token_ids)


@dataclass
class SchedulerLimits:
    chunked_prefill_size: int
    max_running_requests: int
    step: BudgetPolicy  # the prefill budget of a step that also decodes
    max_running_requests_per_tenant: int | None = None
    # LoRA: whether a sequence's adapter may join the live ones' (slots bound a step's adapters).
    lora_may_enter: Callable[[LoraAdapter | None, Iterable[LoraAdapter | None]], bool] | None = (
        None
    )
    on_time_first: bool = False  # a PD role: Scheduler.share_prompts


class Scheduler:
    def __init__(self, pool: KVPool, limits: SchedulerLimits, faults: Faults | None = None) -> None:
        self.pool = pool
        self.faults = faults if faults is not None else Faults()
        self.limits = limits
        # The engine feeds it each step's measured time; it sizes prefill beside decodes.
        self.step_budget = StepBudget(limits.step)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order
        self.handoff: dict[str, Sequence] = {}  # pages held for a KV transfer
        self.reserved: list[Sequence] = []  # DECODE_ONLY entries given pages this step
        self.num_preemptions = 0
        # Cache keys of pages a running sequence is computing and will seal: an identical
        # prompt (n > 1, a retry) waits for them rather than computing them a second time.
        self.inflight: dict[bytes, Sequence] = {}
        # Waves (kvfence/engine/waves.py): whether the last step filled one, and the streams
        # whose first token came out during the fill (its leader first).
        self._filling = False
        self._wave_firsts: list[Sequence] = []
        # A cut (waves.py CUT): its prompts' request ids until they finish, and whether it still
        # holds their first tokens.
        self._cut: set[str] = set()
        self._cutting = False

    def share_prompts(self, hold_tpot: bool) -> None:
        """This engine is a PD role, whose prompts have another worker to be computed by: with a
        TTFT target, the waiting prompts that can still meet it enter first (entry.py);
        hold_tpot (a decode worker that takes prompts): its floors are held within two TPOT
        targets (step_budget.held_to_tpot)."""
        self.limits.on_time_first = True
        if hold_tpot:
            self.limits.step = replace(self.limits.step, tpot_over_floors=True)
            self.step_budget.policy = self.limits.step

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.mode is not SeqMode.DECODE_ONLY:  # a transferred prompt is never computed here
            self.step_budget.arrive(len(seq.token_ids))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def pages_in_handoff(self) -> int:
        """Pages held for KV transfers. Read from other threads (metrics): the dict may change
        mid-iteration, so retry; -1 if it never held still."""
        for _ in range(5):
            try:
                return sum(len(s.pages) for s in list(self.handoff.values()))
            except RuntimeError:
                continue
        return -1

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
                self._forget_inflight(seq)
                self.pool.free_grant(seq.grant)  # and drops its cache references, by grant
                seq.pages, seq.num_sealed, seq.grant = [], 0, None
            else:
                self.release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self, now: float = 0.0) -> list[ScheduledChunk]:
        """This step's chunks; `now` (the engine's clock) is only read for latency targets."""
        self.pool.expire_prefix()
        chunks: list[ScheduledChunk] = []
        preempted_before = self.num_preemptions
        decoding = [s for s in self.running if s.in_decode]
        wave = self._wave(decoding, now)
        if wave is Wave.CUT:
            return self._cut_step(chunks, now)
        if wave is not Wave.FILL:  # a fill's streams (its leader, its held prompts) wait for it
            self._decode(decoding, chunks)
        # Prefill tokens to compute this step: the whole chunk size when nothing decodes, else
        # what the step-time target leaves beside these decodes. Only computed tokens are
        # charged: a prompt's cached prefix is skipped by _enter before its chunk is sized.
        # Streams whose KV is on its way from prefill (a decode that also computes prompts,
        # pd/local_prefill.py) count as decoding: they join at the next step, and a whole-chunk
        # step would hold their second token.
        rows = len(chunks) + sum(_by_transfer(s) for s in self.handoff.values())
        budget = self.step_budget.for_step(
            rows,
            self._backlog() if rows else 0,
            self._deadlines(decoding, now) if rows else None,
        )
        if wave is Wave.FILL:
            budget = self._fill_stop(budget)
        if wave is Wave.RELEASE:
            budget = 0  # the held first tokens alone (a wave's has nothing else left; a cut's
            # would add the step budget's backlog share to its streams' first gap)
        for seq in self.running:
            if budget == 0:
                break
            if not seq.in_decode and seq.status is SeqStatus.RUNNING:
                n = self._hold(seq, min(seq.num_uncomputed, budget), wave)
                if n:
                    chunks.append(_chunk(seq, n))
                    budget -= n
        # After a preemption the pool is short: admitting now would only thrash. A deferred
        # prompt waits for the streams to drain (a wave computes it).
        may_admit = self.num_preemptions == preempted_before and wave not in (
            Wave.DEFER,
            Wave.RELEASE,
        )
        on_time = False  # a prompt that can be on time computes this step (entry.py)
        while may_admit:
            seq, late = self._admit_next(budget, now, on_time_only=on_time)
            if seq is None:
                break
            on_time |= not late and seq.status is SeqStatus.RUNNING
            if seq.status is not SeqStatus.RUNNING:
                continue  # a decode's reservation: its KV arrives by transfer
            n = self._hold(seq, min(seq.num_uncomputed, budget), wave)
            if n:
                chunks.append(_chunk(seq, n))
                budget -= n
        if wave is Wave.FILL and chunks:
            self._early_firsts(chunks)
        if wave is Wave.FILL and not chunks:
            # Nothing more could join or be computed (the pool, a cap): the wave starts now.
            self._filling = False
            self._decode([s for s in self.running if s.in_decode], chunks)
        return chunks

    def _admit_next(
        self, budget: int = 1, now: float = 0.0, on_time_only: bool = False
    ) -> tuple[Sequence | None, bool]:
        """The next waiting sequence into the running set (fair order, entry.entry_order's),
        or None when it has to wait (no slot, its tenant's cap, its twin's pages, its adapter,
        the pool; no budget; on_time_only and it would be late: a late prompt's tokens would
        only delay the step's on-time first tokens); and whether it enters late."""
        if not self.waiting or len(self.running) >= self.limits.max_running_requests:
            return None, False
        step = self.limits.step
        order, on_time = entry_order(
            self.waiting, self.running, budget,
            step.target_ttft_ms if self.limits.on_time_first else None,
            self.step_budget.model.cost(), step.max_chunk, now,
        )  # fmt: skip
        pick = next_waiting(
            [self.waiting[i] for i in order],
            self.running,
            self.limits.max_running_requests_per_tenant,
            self.faults.guards().on("fair_share"),
        )
        if pick is None or (on_time_only and pick >= on_time):
            return None, False  # every waiting tenant holds its cap, or a late one's turn
        late, pick = pick >= on_time, order[pick]
        seq = self.waiting[pick]
        hit = self._lookup(seq)
        if self._awaits_twin(seq, len(hit)):
            return None, False  # its next page is being computed right now; it reuses it next step
        # The hit's pages are shared, not taken; those nobody references yet stop being
        # evictable once this sequence holds them.
        if not self._adapter_fits(seq):
            return None, False  # its adapter needs a slot the running ones hold; it waits, in order
        needed = self.pool.pages_for(len(seq.token_ids)) - len(hit)
        if needed > self.pool.num_free - self.pool.num_evictable_among(hit):
            return None, False  # the pick waits: later arrivals never overtake it
        del self.waiting[pick]
        seq.grant = self.pool.new_grant(seq.tenant, seq.request_id)
        self._enter(seq, len(hit), needed)
        if seq.mode is SeqMode.DECODE_ONLY and not seq.output_ids:
            # Pre-allocated for the whole prompt; its KV arrives by transfer, not compute.
            seq.status = SeqStatus.HANDOFF
            self.handoff[seq.request_id] = seq
            self.reserved.append(seq)
            return seq, late
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return seq, late

    def _cut_step(self, chunks: list[ScheduledChunk], now: float) -> list[ScheduledChunk]:
        """A CUT step (waves.py): every stream decodes, the waiting prompts enter, and a whole
        chunk serves the prompts in waves.cut_order; the others hold their last token."""
        preempted_before = self.num_preemptions
        self._decode([s for s in self.running if s.in_decode and s.output_ids], chunks)
        self.step_budget.for_step(len(chunks))  # the arrival pace ticks once a step
        while self.num_preemptions == preempted_before and self._admit_next()[0] is not None:
            pass  # (after a preemption the pool is short: admitting would only thrash)
        ttft = self.limits.step.target_ttft_ms or 0.0
        todo = [
            s
            for s in self.running
            if not s.output_ids and s.status is SeqStatus.RUNNING and not s.in_decode
        ]
        work = [(s.num_uncomputed, _ms_left(s, ttft, now)) for s in todo]
        taken = {i for i, s in enumerate(todo) if s.request_id in self._cut}
        budget = self.limits.step.max_chunk
        for i in cut_order(work, taken, ttft):
            if budget == 0:
                break
            seq = todo[i]
            n = min(seq.num_uncomputed, budget)
            if i not in taken and n == seq.num_uncomputed and seq.num_computed + n > 1:
                n -= 1  # held: its first token waits for the cut's release
            if n:
                chunks.append(_chunk(seq, n))
                budget -= n
        return chunks

    def _decode(self, decoding: list[Sequence], chunks: list[ScheduledChunk]) -> None:
        """A one-token chunk for each decoding sequence that (still) has a slot."""
        for seq in decoding:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted by an earlier sequence in this loop
            if self._ensure_slot(seq):
                chunks.append(_chunk(seq, 1))

    def _wave(self, decoding: list[Sequence], now: float) -> Wave:
        """This step's wave mode (kvfence/engine/waves.py): only with both latency targets set
        and only where every sequence is computed and decoded here (a PD role's transfers run
        on their own clock)."""
        step = self.limits.step
        if step.target_tpot_ms is None or step.target_ttft_ms is None or any(
            s.mode is not SeqMode.FULL
            for s in (*self.running, *self.waiting, *self.handoff.values())
        ):
            self._filling = self._cutting = False
            return Wave.OFF
        if self._cutting:
            return self._cut_mode(now)
        if self._cut_live():  # its streams decode: the step budget, no wave (waves.py CUT)
            self._filling = False
            return Wave.OFF
        streams = [
            s.admitted.max_tokens - s.num_output
            for s in decoding
            if s.output_ids and not (self._filling and s in self._wave_firsts)
        ]
        prompts = list(self._prompt_work(now))
        held = all(s.num_uncomputed <= 1 for s in self.running if not s.output_ids)
        filled = held and (
            not self.waiting or len(self.running) >= self.limits.max_running_requests
        )
        was_filling = self._filling
        wave = mode(
            was_filling,
            streams,
            prompts,
            self.step_budget.model.cost(),
            step.max_chunk,
            filled,
        )
        self._filling = wave is Wave.FILL
        if self._filling and not was_filling:
            self._wave_firsts = []
        if wave is Wave.OFF and prompts and step.ttft_cuts:
            return self._start_cut(now)
        return wave

    def _cut_live(self) -> bool:
        """Whether a prompt of the last cut is still here (it finished: it left both queues)."""
        if not self._cut:
            return False
        live = {s.request_id for s in (*self.running, *self.waiting)}
        self._cut &= live
        return bool(self._cut)

    def _start_cut(self, now: float) -> Wave:
        """CUT with the prompts waves.cut takes, or OFF when it takes none."""
        seqs = list(self._prompt_seqs())
        ttft = self.limits.step.target_ttft_ms or 0.0
        work = [(_to_compute(s), _ms_left(s, ttft, now)) for s in seqs]
        taken = cut(self.step_budget.model.cost(), self.limits.step.max_chunk, work)
        if not taken:
            return Wave.OFF
        self._cut = {seqs[i].request_id for i in taken}
        self._cutting = True
        return Wave.CUT

    def _cut_mode(self, now: float) -> Wave:
        """A cut in progress: CUT again, or RELEASE once waves.cut_release says it ends."""
        ttft = self.limits.step.target_ttft_ms or 0.0
        mine = [_ms_left(s, ttft, now) for s in self._prompt_seqs() if s.request_id in self._cut]
        if cut_release(mine):
            self._cutting = False
            return Wave.RELEASE
        return Wave.CUT

    def _prompt_work(self, now: float) -> Iterable[tuple[int, float]]:
        """(tokens to compute, ms left to the TTFT target) of each prompt with no first token:
        running (held ones too) and waiting."""
        ttft = self.limits.step.target_ttft_ms or 0.0
        for s in self._prompt_seqs():
            yield _to_compute(s), _ms_left(s, ttft, now)

    def _prompt_seqs(self) -> Iterable[Sequence]:
        """The prompts with no first token: running (held ones too), then waiting."""
        for s in self.running:
            if not s.output_ids and s.status is SeqStatus.RUNNING:
                yield s
        for s in self.waiting:
            if not s.output_ids:
                yield s

    def _hold(self, seq: Sequence, n: int, wave: Wave) -> int:
        """The tokens of seq's chunk this step: in a fill, one short of its prompt's end (its
        first token waits for the wave), unless it leads the wave."""
        if wave is not Wave.FILL or n < seq.num_uncomputed or seq.output_ids:
            return n
        if not self._wave_firsts:
            self._wave_firsts.append(seq)
            return n
        return n - 1

    def _early_firsts(self, chunks: list[ScheduledChunk]) -> None:
        """In a fill: first tokens for the held prompts that may have them before the wave ends
        (engine/fill.py), oldest first; each such chunk computes its last prompt token."""
        now = {c.seq.request_id: c.length for c in chunks}
        fill = Fill.of(self.running, self.waiting, self._wave_firsts, now)
        for seq in fill.firsts(*self._early_terms()):
            chunks.append(_chunk(seq, 1))
            self._wave_firsts.append(seq)

    def _fill_stop(self, budget: int) -> int:
        """A fill step's prompt tokens: up to where held prompts may start to have early first
        tokens, then up to each next prompt's held token (engine/fill.py)."""
        fill = Fill.of(self.running, self.waiting, self._wave_firsts, {})
        return fill.stop(*self._early_terms(), budget)

    def _early_terms(self) -> tuple[StepCost | None, int, float]:
        step = self.limits.step
        assert step.target_tpot_ms is not None
        return self.step_budget.model.cost(), step.max_chunk, step.target_tpot_ms

    def _backlog(self) -> int:
        """Prompt tokens waiting to be computed: the rest of the running prefills, and the
        waiting prompts whole (their cached prefix is only looked up when they enter); not a
        decode's prompts whose KV will arrive by transfer."""
        running = sum(s.num_uncomputed for s in self.running if not s.in_decode)
        return running + sum(len(s.token_ids) for s in self.waiting if not _by_transfer(s))

    def _deadlines(self, decoding: list[Sequence], now: float) -> Deadlines | None:
        """Where the decoding streams and the waiting prompts stand against the latency
        targets (None: neither is set)."""
        tpot, ttft = self.limits.step.target_tpot_ms, self.limits.step.target_ttft_ms
        if tpot is None and ttft is None:
            return None
        slack, lost = None, False
        if tpot is not None:
            cost = self.step_budget.model.cost()
            rows = [
                (s.first_token_at, s.num_output, s.admitted.max_tokens - s.num_output)
                for s in decoding
                if s.status is SeqStatus.RUNNING and s.first_token_at is not None
            ]
            # The fastest these rows can go: a decode-only step of them all.
            fastest = cost.predict(0, len(rows)) if cost is not None else 0.0
            kept = [(f, n) for f, n, left in rows if not tpot_lost(tpot, f, n, left, fastest, now)]
            slack, lost = tpot_slack_ms(tpot, kept, now), bool(rows) and not kept
        prompts: list[tuple[int, float]] = []
        if ttft is not None:
            cum = 0
            for s in self._in_service_order():
                cum += _to_compute(s)
                prompts.append((cum, _ms_left(s, ttft, now)))
        return Deadlines(slack, tuple(prompts), lost)

    def _in_service_order(self) -> Iterable[Sequence]:
        """The prompts still to compute here, in the order their chunks are served: the
        running ones, then the queue (a preempted stream has no first-token deadline left)."""
        for s in self.running:
            if not s.in_decode and s.status is SeqStatus.RUNNING and not s.output_ids:
                yield s
        for s in self.waiting:
            if s.mode is not SeqMode.DECODE_ONLY and not s.output_ids:
                yield s

    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached pages seq may start from (none without a cache). At least its last token
        is always computed (by prefill, in PD): that step samples the next one. PD roles look up
        like a unified engine: prefill computes only beyond its own hit, decode reserves only
        beyond its own (RESERVE tells prefill how many pages it holds)."""
        prefix = self.pool.prefix
        if prefix is None or seq.prompt_scores is not None:
            # Prompt logprobs need every prompt position's logits, which a cached page does not
            # keep: such a request recomputes its whole prompt (and seals nothing, so it neither
            # waits for a twin's pages nor shows a hit). In PD the same rule on both roles makes
            # decode reserve, and prefill compute and send, the whole prompt.
            return []
        if seq.chain is None:
            ns = Namespace.of_tenant(
                seq.tenant, seq.admitted.request.cache_salt, lora_identity(seq.lora, self.faults)
            )
            seq.chain = prefix.chain(seq.token_ids, ns)
        else:
            prefix.extend(seq.chain, seq.token_ids)  # tokens it generated before a preemption
        max_pages = (len(seq.token_ids) - 1) // self.pool.page_size
        return [e.page for e in prefix.lookup(seq.chain, seq.token_ids, max_pages)]

    def _adapter_fits(self, seq: Sequence) -> bool:
        gate = self.limits.lora_may_enter
        if gate is None or seq.lora is None:
            return True
        live = [s.lora for s in self.running] + [s.lora for s in self.handoff.values()]
        return gate(seq.lora, live)

    def _awaits_twin(self, seq: Sequence, n_hit: int) -> bool:
        if seq.chain is None or n_hit >= (len(seq.token_ids) - 1) // self.pool.page_size:
            return False
        if _by_transfer(seq):
            return False  # its twin's pages arrive after a whole transfer: not worth the wait
        return self.inflight.get(seq.chain.keys[n_hit], seq) is not seq

    def _forget_inflight(self, seq: Sequence) -> None:
        if seq.chain is not None:
            for key in seq.chain.keys:
                if self.inflight.get(key) is seq:
                    del self.inflight[key]

    def _enter(self, seq: Sequence, n_hit: int, n_new: int) -> None:
        """seq takes its n_hit cached pages by reference and n_new pages under its grant."""
        assert seq.grant is not None
        shared: list[int] = []
        if n_hit:
            assert seq.chain is not None
            shared = self.pool.match_prefix(seq.grant, seq.chain, seq.token_ids, n_hit)
            assert len(shared) == n_hit, "the cache changed between lookup and match"
        elif seq.chain is not None and self.pool.prefix is not None:
            self.pool.prefix.queried(len(seq.token_ids))  # a miss counts as a query too
        pages = shared + self.pool.allocate(seq.grant, n_new)
        seq.pages = self.faults.hook("write_sealed_page", pages, n_hit=n_hit)
        seq.num_sealed = n_hit
        seq.may_seal = True
        if seq.chain is not None and not _by_transfer(seq):
            for key in seq.chain.keys[n_hit:]:
                self.inflight.setdefault(key, seq)
        seq.num_computed = n_hit * self.pool.page_size
        if not seq.output_ids:
            seq.cached_tokens = seq.num_computed

    def seal(self, seq: Sequence) -> None:
        """Seal seq's full, computed pages into the prefix cache (they stay its pages to read,
        by reference now; the grant no longer owns them)."""
        if seq.chain is None or not seq.may_seal or seq.grant is None:
            return
        full = seq.num_computed // self.pool.page_size
        if full <= seq.num_sealed:
            return
        self.pool.prefix.extend(seq.chain, seq.token_ids)
        run = seq.pages[seq.num_sealed : full]
        sealed = self.pool.seal(seq.grant, seq.chain, seq.num_sealed, run, seq.token_ids)
        for key in seq.chain.keys[seq.num_sealed : seq.num_sealed + sealed]:
            if self.inflight.get(key) is seq:
                del self.inflight[key]
        seq.num_sealed += sealed
        seq.may_seal = sealed == len(run)
        if not seq.may_seal:
            self._forget_inflight(seq)

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
        self.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Return seq's pages (and its cache references): the one path every sequence's pages
        take back to the pool, the boot warm-up's too (engine/warmup.py)."""
        assert seq.grant is not None
        self._forget_inflight(seq)
        self.pool.release_prefix(seq.grant)
        try:
            self.pool.free(seq.grant, seq.own_pages)
        except OwnershipError:
            # The page list is corrupt (a bug elsewhere): free what the grant really owns, so
            # the pool stays sound and no foreign page is handed out twice.
            log.error(
                "request %s: page list not owned by its grant; freeing by grant", seq.request_id
            )
            self.pool.free_grant(seq.grant)
        seq.pages = []
        seq.num_sealed = 0
        seq.grant = None


def _to_compute(seq: Sequence) -> int:
    """Prompt tokens seq still has to compute (a waiting one: all of them)."""
    return seq.num_uncomputed if seq.status is SeqStatus.RUNNING else len(seq.token_ids)


def _chunk(seq: Sequence, n: int) -> ScheduledChunk:
    """seq's next n tokens, with the prompt positions they score."""
    return ScheduledChunk(
        seq, seq.num_computed, n, scored_range(seq.prompt_scores, seq.num_computed, n)
    )
