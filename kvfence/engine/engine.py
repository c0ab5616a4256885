"""Engine: admission, the step loop (schedule -> run -> postprocess) and its thread.

Callers on other threads only `submit`, `abort` and (PD layer) `commit` / `fail` / `release`;
all hand work to the loop through an inbox, so the pool, scheduler and sequences are touched by
one thread alone. In PD roles the same core runs; a sequence only parks in HANDOFF, with its
pages held, while the transfer owns them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvfence.config import EngineConfig
from kvfence.engine import parts
from kvfence.engine.admission import ENGINE_FAILED, AdmissionLimits, Admitted, Rejected, admit
from kvfence.engine.openmp import release_thread_pool
from kvfence.engine.output import advance, emit, logprob_entry, sendable_upto
from kvfence.engine.prompt_logprobs import MISSING, keep_scores, receive
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from kvfence.engine.runner import StepResult
from kvfence.engine.scheduler import ScheduledChunk, Scheduler, SchedulerLimits
from kvfence.engine.sequence import SeqMode, SeqStatus, Sequence
from kvfence.engine.step_budget import BudgetPolicy
from kvfence.engine.tp_group import TpBroken
from kvfence.engine.warmup import boot
from kvfence.faults import Faults
from kvfence.kv.prefix import PrefixCacheStats
from kvfence.kv.sizing import CapacityError, PoolPlan
from kvfence.lora.runtime import LoraRuntime
from kvfence.model.config import ModelConfig
from kvfence.model.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    load_tokenizer,
    stop_token_ids,
)
from kvfence.structured.grammar import GrammarError, Grammars, Matcher

log = logging.getLogger("kvfence.engine")

__all__ = ["CapacityError", "Engine", "EngineStats", "HandoffHooks"]


class HandoffHooks(Protocol):
    """The PD layer's callbacks, called on the engine thread; they must not block."""

    def on_reserved(self, seq: Sequence) -> None:
        """Decode: seq holds pages for its whole prompt; send RESERVE."""

    def on_prefilled(self, seq: Sequence) -> None:
        """Prefill: seq's prompt KV is in its pages and its first token is sampled; send."""

    def on_abort(self, seq: Sequence) -> None:
        """A HANDOFF seq was aborted; its pages stay held until `release`."""


DRAINING = "draining"
DRAINING_MESSAGE = "This worker is shutting down and admits no new requests; retry on another."


@dataclass(frozen=True)
class EngineStats:
    pages_total: int
    pages_used: int
    pages_free: int
    page_size: int
    pool_tokens: int
    running: int
    waiting: int
    preemptions: int
    handoff: int = 0  # sequences whose pages a transfer holds
    pages_handoff: int = 0  # their pages
    integrity_failures: int = 0  # requests failed closed by the ownership check (I2)
    prefix_cache: PrefixCacheStats | None = None  # None: the prefix cache is off


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        faults: Faults | None = None,
        hooks: HandoffHooks | None = None,
    ) -> None:
        """hooks: the PD role's hand-off callbacks (None for a unified engine, which never
        parks a sequence in HANDOFF); faults: this process's fault points (none armed)."""
        self.cfg = cfg
        self.faults = faults if faults is not None else Faults()
        self.hooks = hooks
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.model_name = cfg.served_model_name or Path(cfg.model).resolve().name
        self.device = torch.device(cfg.device)
        if cfg.threads is not None and cfg.tp_size == 1:
            # Process-wide (one engine per process); ATen's parallel_for, which the native
            # kernels use too, starts every later parallel region with this many threads.
            # Tensor-parallel ranks each take their share instead (TpLeader).
            torch.set_num_threads(cfg.threads)
        self.plan: PoolPlan = parts.plan_or_refuse(cfg, self.model_config)
        # The plan resolved the flags' defaults (context length, KV dtype); nothing re-derives them.
        self.context_length = self.plan.context_length
        self.tokenizer = load_tokenizer(cfg, self.model_config.vocab_size)
        self.tp = parts.tp_leader(cfg, self.model_config, self.plan)
        self._failed: str | None = None  # why the engine failed closed for good (a lost rank)
        self.model = parts.model(cfg, self.device, self.context_length, self.tp)
        self.prefix_caching = cfg.enable_prefix_caching
        prefix = (
            parts.prefix_cache(cfg, self.tokenizer, self.model_config.vocab_size, self.faults)
            if cfg.enable_prefix_caching
            else None
        )
        self.pool = parts.kv_pool(cfg, self.model_config, self.plan, self.device, self.tp, prefix)
        self.limits = AdmissionLimits(
            context_length=self.context_length,
            pool_tokens=self.pool.capacity_tokens,
            vocab_size=self.model_config.vocab_size,
        )
        self.scheduler = Scheduler(
            self.pool,
            SchedulerLimits(
                cfg.chunked_prefill_size,
                cfg.max_running_requests,
                BudgetPolicy(
                    max_chunk=cfg.chunked_prefill_size,
                    min_chunk=cfg.min_prefill_chunk,
                    max_decode_step_ms=cfg.max_decode_step_ms,
                    token_cap=cfg.decode_step_prefill_budget,
                    backlog_steps=cfg.prefill_backlog_steps,
                    pace=cfg.prefill_pace,
                    wide_factor=cfg.wide_step_factor,
                    target_tpot_ms=cfg.target_tpot_ms,
                    target_ttft_ms=cfg.target_ttft_ms,
                    ttft_cuts=cfg.ttft_cuts,
                ),
                cfg.max_running_requests_per_tenant,
            ),
            self.faults,
        )
        self.eos_token_ids = stop_token_ids(
            Path(cfg.model), self.model_config.eos_token_ids, self.tokenizer
        )
        self.grammars = Grammars(
            # None: no tokenizer (--skip-tokenizer-init), so no grammar can be mapped to tokens
            self.tokenizer.backend_json() if isinstance(self.tokenizer, Tokenizer) else None,
            self.model_config.vocab_size,
            sorted(self.eos_token_ids),
        )
        self.runner = parts.runner(
            cfg,
            self.model,
            self.pool,
            self.device,
            self.faults,
            self.grammars,
            self.tp,
            self.context_length,
        )
        if self.tp is not None:
            self.tp.on_broken = lambda: self._wake.set()
        # Multi-LoRA: adapters bound to the fused projections; the scheduler admits no more
        # distinct adapters than there are slots.
        self.lora = (
            LoraRuntime(cfg, self.model_config, self.model, self.model_name, self.device)
            if cfg.enable_lora
            else None
        )
        if self.lora is not None:
            self.runner.lora = self.lora.slots
            self.scheduler.limits.lora_may_enter = self.lora.may_enter
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._seqs: dict[str, Sequence] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self.integrity_failures = 0
        # Called on the engine thread after each pass of the loop (add them before start()): a
        # sink that batches (kvfence/engine/outbox.py) sends one step's outputs at once.
        self.step_end_hooks: list[Callable[[], None]] = []
        # The CPU threads each step's kernels run on, asked before it (None: cfg.threads
        # throughout): a PD decode lends itself its prefill worker's idle cores
        # (kvfence/pd/local_prefill.py, PendingPrompts.step_threads).
        self.step_threads: Callable[[], int] | None = None
        self._threads = cfg.threads

    # ---- called from any thread -------------------------------------------------------------

    def submit(
        self,
        req: GenerateRequest,
        sink: Callable[[RequestOutput], None],
        mode: SeqMode = SeqMode.FULL,
    ) -> Admitted | Rejected:
        """Admission runs here, in the caller's thread: a Rejected never reaches the loop. So
        does compiling a structured-output grammar (cached, bounded): never on the step loop."""
        verdict = self.admit(req)
        if isinstance(verdict, Admitted):
            matcher = None
            if req.sampling.constraint is not None:
                try:
                    matcher = self.grammars.matcher(req.sampling.constraint, req.tenant)
                except GrammarError as e:
                    return Rejected(req.request_id, e.code, str(e))
            self._post("add", (verdict, sink, mode, matcher))
        return verdict

    def admit(self, req: GenerateRequest) -> Admitted | Rejected:
        """The admission rule (I1) against this engine's limits, queueing nothing."""
        if self._failed is not None:
            return Rejected(req.request_id, ENGINE_FAILED, self._failed, status=503)
        if self._draining.is_set():
            return Rejected(req.request_id, DRAINING, DRAINING_MESSAGE, status=503)
        return admit(req, self.limits, self.faults.guards())

    def stop_admitting(self) -> None:
        """Graceful drain: every later admission, at every door (HTTP, RESERVE), is a 503;
        what was admitted runs to its end."""
        self._draining.set()

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    def commit(self, request_id: str, first_token: int, first_logprobs: dict | None = None) -> None:
        """Decode: the transferred KV of a HANDOFF seq was verified; start decoding."""
        self._post("commit", (request_id, first_token, first_logprobs or {}))

    def fail(self, request_id: str, error: str, code: str, status: int) -> None:
        """Tell a HANDOFF seq's client it failed; its pages stay held until `release`."""
        self._post("fail", (request_id, error, code, status))

    def release(self, request_id: str) -> None:
        """No writer or reader of a HANDOFF seq's pages remains: return them (I4)."""
        self._post("release", request_id)

    def stats(self) -> EngineStats:
        pool, sched = self.pool, self.scheduler
        return EngineStats(
            pages_total=pool.num_pages,
            pages_used=pool.num_used,
            pages_free=pool.num_free,
            page_size=pool.page_size,
            pool_tokens=pool.capacity_tokens,
            running=len(sched.running),
            waiting=len(sched.waiting),
            preemptions=sched.num_preemptions,
            handoff=len(sched.handoff),
            pages_handoff=sched.pages_in_handoff(),
            integrity_failures=self.integrity_failures,
            prefix_cache=pool.prefix.stats() if pool.prefix is not None else None,
        )

    def start(self) -> None:
        # From here on the loop's thread computes (the warm-up first); the OpenMP workers the
        # model's load left on this thread would make each of its parallel regions wait.
        release_thread_pool()
        booted: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._loop, args=(booted,), name="kvfence-engine", daemon=True
        )
        self._thread.start()
        if (failed := booted.get()) is not None:
            raise failed

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.tp is not None:
            self.tp.close()

    def loop_thread(self) -> threading.Thread | None:
        """The thread that owns the pool while the loop runs (None before start and after it
        ended): what the PD layer's pool port checks its callers against."""
        t = self._thread
        return t if t is not None and t.is_alive() else None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failed is None

    def _post(self, kind: str, payload: object) -> None:
        self._inbox.put((kind, payload))
        self._wake.set()

    # ---- the loop (engine thread only) ------------------------------------------------------

    def _loop(self, booted: queue.SimpleQueue[BaseException | None]) -> None:
        if not boot(self, booted):
            return
        while not self._stopping.is_set():
            self._send_outputs()  # what the last step emitted leaves before the loop waits or steps
            if not self.has_work():
                self._go_idle()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            if self._failed is not None:
                # A request admitted just before the failure may still reach the inbox: the loop
                # stays to answer it with the error rather than leave it waiting.
                self._fail_closed(self._failed)
                continue
            try:
                self.step()
            except Exception as e:
                if self.tp is not None:
                    # A step's collectives left the ranks out of step (a rank died or stalled,
                    # or this one failed between two collectives): nothing can run here again.
                    self.tp.fail(self.tp.broken or f"rank 0 failed a step ({e!r})")
                    self._fail_closed(
                        "This engine lost a tensor-parallel rank and serves nothing more: "
                        + (self.tp.broken or "tensor-parallel group broken")
                    )
                    continue
                log.exception("engine step failed; failing the running requests closed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, "internal engine error", "engine_error")
        self._send_outputs()

    def _send_outputs(self) -> None:
        for hook in self.step_end_hooks:
            hook()

    def _fail_closed(self, reason: str) -> None:
        """Every request this engine holds or was sent ends with an error (I5); every later
        admission is a 503 and `alive` is False (/health, /live say so)."""
        if self._failed is None:
            log.error("engine failed closed: %s", reason)
        self._failed = reason
        self._drain_inbox()  # requests that arrived before admission saw the failure
        # HANDOFF sequences too: a PD role's rooms hear through their sinks (prefill) or their
        # clients (decode); this pool is never used again, so no late write can reach a reader.
        for seq in list(self._seqs.values()):
            self._finish(seq, FinishReason.ERROR, self._failed, ENGINE_FAILED, status=503)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> None:
        if self.tp is not None and self.tp.broken is not None:
            raise TpBroken(self.tp.broken)
        self._drain_inbox()
        # What the inbox emitted leaves now, not behind this step's forward: a PD decode's first
        # token, computed by the prefill and shown at commit, waited a whole decode step in the
        # outbox (fp32 135M, one 256-token request at a time on 2 cores, interleaved: PD's TTFT
        # 349 / 351 ms against 382 / 361).
        self._send_outputs()
        chunks = self.scheduler.schedule(time.monotonic())
        self._hand_off_reserved()
        if not chunks:
            return
        decode_rows = sum(c.seq.in_decode for c in chunks)
        prefill_tokens = sum(c.length for c in chunks if not c.seq.in_decode)
        if self.step_threads is not None:
            self._use_threads(self.step_threads())
        t0 = time.perf_counter()
        result = self.runner.run(chunks)
        self._postprocess(chunks, result)
        # What a stream waits between two tokens: the forward and everything after it.
        ms = (time.perf_counter() - t0) * 1000
        self.scheduler.step_budget.observe(prefill_tokens, decode_rows, ms)

    def _use_threads(self, n: int) -> None:
        """Later parallel regions of this thread run on `n` threads (OpenMP's count is the
        calling thread's: so it is set here, on the engine thread)."""
        if n != self._threads:
            torch.set_num_threads(n)
            self._threads = n

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*payload)  # type: ignore[misc]
                continue
            rid = payload[0] if isinstance(payload, tuple) else payload
            seq = self._seqs.get(rid)  # type: ignore[arg-type]
            if seq is None:
                continue  # finished already: every later message is a no-op
            if kind == "abort":
                self._abort(seq)
            elif kind == "commit" and seq.status is SeqStatus.HANDOFF:
                if seq.client_done:
                    # The client left while the last pages were in flight; the transfer is
                    # complete now, so no writer remains and the pages can go.
                    self._finish(seq, FinishReason.ABORT)
                else:
                    self._commit(seq, payload[1], payload[2])  # type: ignore[index]
            elif kind == "fail":
                _, error, code, status = payload  # type: ignore[misc]
                emit(seq, len(seq.text), FinishReason.ERROR, error, code, status)
            elif kind == "release" and seq.status is SeqStatus.HANDOFF:
                self._finish(seq, FinishReason.ABORT)

    def _add(
        self,
        admitted: Admitted,
        sink: Callable[[RequestOutput], None],
        mode: SeqMode,
        matcher: Matcher | None = None,
    ) -> None:
        req = admitted.request
        gen = None
        if req.sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(req.sampling.seed)
        detok = IncrementalDetokenizer(self.tokenizer)
        seq = Sequence(admitted, sink, mode, detok, gen, matcher=matcher)
        if req.request_id in self._seqs:
            emit(seq, 0, FinishReason.ERROR, "duplicate request id", "duplicate_request_id", 400)
            return
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _abort(self, seq: Sequence) -> None:
        if seq.status is not SeqStatus.HANDOFF:
            self._finish(seq, FinishReason.ABORT)
            return
        # A transfer may still touch these pages: the client hears now, the pages wait (I4).
        emit(seq, len(seq.text), FinishReason.ABORT)
        if self.hooks is not None:
            self.hooks.on_abort(seq)

    def _commit(self, seq: Sequence, first_token: int, first_logprobs: dict) -> None:
        seq.num_computed = seq.prompt_len
        self.scheduler.resume(seq)
        probe = ScheduledChunk(seq, seq.prompt_len, 1)
        if self.runner.check_ownership([probe])[1]:
            # I2 before a single token is shown: the transferred pages must be this grant's.
            self._fail_integrity(seq)
            return
        # The verified prompt pages pass to decode's prefix cache now (a 1-token answer never
        # reaches a decode step, where the rest of a sequence's pages are sealed).
        self.scheduler.seal(seq)
        problem = receive(seq.prompt_scores, first_logprobs)
        if problem is not None and self.faults.guards().on("prompt_logprobs_whole"):
            self._finish(seq, FinishReason.ERROR, problem, MISSING, status=500)  # I5
            return
        if not self._keeps_grammar(seq, first_token):  # prefill sampled it under the same mask
            return
        seq.token_ids.append(first_token)
        if seq.admitted.request.sampling.logprobs is not None and first_logprobs:
            top = tuple((int(t), float(v)) for t, v in first_logprobs.get("top", ()))
            seq.pending_logprobs.append(
                TokenLogprob(first_token, float(first_logprobs["logprob"]), top)
            )
        self._after_token(seq, first_token)

    def _hand_off_reserved(self) -> None:
        reserved, self.scheduler.reserved = self.scheduler.reserved, []
        for seq in reserved:
            assert self.hooks is not None, "DECODE_ONLY needs a PD receiver"
            self.hooks.on_reserved(seq)

    def _go_idle(self) -> None:
        """Nothing left to step: give back this thread's OpenMP workers. Left alone, they spin
        on for milliseconds after the last parallel region (GOMP_SPINCOUNT) on a core that the
        server's other threads need, a PD transfer of this step's KV above all (2 cores: 2.4 ms
        of CPU in a 13 ms transfer window, benchmarks/RESULTS.md "KV transfer"). The next step
        starts them again (tens of microseconds, once per busy spell)."""
        release_thread_pool()

    def _postprocess(self, chunks: list[ScheduledChunk], result: StepResult) -> None:
        prefilled: list[Sequence] = []  # held for a PD transfer: handed off whatever happens
        try:
            self._apply(chunks, result, prefilled)
        finally:
            if prefilled and not self.has_work():
                # Before the transfers start: the workers exit at once on a core nobody
                # else wants yet (with a transfer running, the exit itself waited for a core).
                self._go_idle()
            for seq in prefilled:
                assert self.hooks is not None, "PREFILL_ONLY needs a PD sender"
                self.hooks.on_prefilled(seq)

    def _apply(
        self, chunks: list[ScheduledChunk], result: StepResult, prefilled: list[Sequence]
    ) -> None:
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
        keep_scores(result.scored, result.scores)
        for chunk in result.rejected:
            self._fail_integrity(chunk.seq)
        for chunk in chunks:
            if chunk.seq.status is SeqStatus.RUNNING:  # not failed closed just now
                self.scheduler.seal(chunk.seq)
        if result.samples is None:
            return
        s = result.samples
        token_ids = s.token_ids.tolist()
        for i, chunk in enumerate(result.sampled):
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            tok = token_ids[i]
            if not self._keeps_grammar(seq, tok):
                continue
            seq.token_ids.append(tok)
            k = seq.admitted.request.sampling.logprobs
            if k is not None:
                seq.pending_logprobs.append(logprob_entry(s, i, tok, k))
            if seq.mode is SeqMode.PREFILL_ONLY and seq.num_output == 1:
                self.scheduler.hold(seq)
                prefilled.append(seq)
                continue
            self._after_token(seq, tok)

    def _keeps_grammar(self, seq: Sequence, tok: int) -> bool:
        """Advance seq's grammar by tok; a token outside it (a step limit hit: the mask let
        nothing through) fails the request closed before the token is kept or shown."""
        if seq.matcher is None or seq.matcher.accept(tok):
            return True
        self._finish(
            seq,
            FinishReason.ERROR,
            f"structured output: {seq.matcher.error()}",
            "grammar_error",
            status=400,  # the tenant's grammar outran its per-token bounds
        )
        return False

    def _fail_integrity(self, seq: Sequence) -> None:
        log.error(
            "kv ownership check failed: tenant=%s request=%s grant=%s pages=%s %s",
            seq.tenant,
            seq.request_id,
            seq.grant.grant_id if seq.grant else None,
            seq.pages,
            self.pool.describe_owners(seq.pages),
        )
        self.integrity_failures += 1
        self._finish(
            seq,
            FinishReason.ERROR,
            "KV cache integrity check failed",
            "kv_integrity_error",
            pages_suspect=True,
        )

    def _after_token(self, seq: Sequence, tok: int) -> None:
        reason = advance(seq, tok, self.eos_token_ids)
        if reason is not None:
            self._finish(seq, reason)
        else:
            emit(seq, sendable_upto(seq), None)

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: str | None = None,
        code: str | None = None,
        pages_suspect: bool = False,
        status: int | None = None,
    ) -> None:
        """Return seq's pages, then send its final output (I5: emit sends it at most once)."""
        if seq.status is SeqStatus.FINISHED:
            return
        self.scheduler.remove(seq, pages_suspect)
        self._seqs.pop(seq.request_id, None)
        emit(seq, len(seq.text), reason, error, code, status)
