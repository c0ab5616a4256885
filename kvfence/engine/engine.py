"""Engine: admission, the step loop (schedule -> run -> postprocess) and its thread.

Callers on other threads only ever `submit` and `abort`; both hand work to the loop through an
inbox, so the pool, scheduler and sequences are touched by one thread alone.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfence.config import EngineConfig
from kvfence.engine.admission import AdmissionLimits, Admitted, Rejected, admit
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, TokenLogprob
from kvfence.engine.runner import ModelRunner, StepResult
from kvfence.engine.scheduler import Scheduler, SchedulerLimits
from kvfence.engine.sequence import SeqStatus, Sequence
from kvfence.kv.pool import KVPool
from kvfence.kv.sizing import CapacityError, PoolPlan, plan_for_engine, require_fits
from kvfence.model.config import ModelConfig
from kvfence.model.loader import TORCH_DTYPES, load_model
from kvfence.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("kvfence.engine")

__all__ = ["CapacityError", "Engine", "EngineStats"]


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


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.model_config = ModelConfig.from_dir(cfg.model)
        self.context_length = cfg.context_length or self.model_config.max_position_embeddings
        self.model_name = cfg.served_model_name or Path(cfg.model).resolve().name
        self.device = torch.device(cfg.device)
        self.plan: PoolPlan = plan_for_engine(cfg, self.model_config)
        require_fits(self.plan)  # I7: refuse to start rather than silently lower the limit
        self.tokenizer = Tokenizer(cfg.model)
        self.model = load_model(cfg.model, cfg.dtype, self.device)
        self.model.init_rope(self.context_length, self.device)
        self.pool = KVPool(
            num_layers=self.model_config.num_layers,
            num_pages=self.plan.pool_pages,
            page_size=cfg.page_size,
            num_kv_heads=self.model_config.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=TORCH_DTYPES[cfg.effective_kv_cache_dtype],
            device=self.device,
        )
        self.limits = AdmissionLimits(
            context_length=self.context_length,
            pool_tokens=self.pool.capacity_tokens,
            vocab_size=self.model_config.vocab_size,
        )
        self.scheduler = Scheduler(
            self.pool, SchedulerLimits(cfg.chunked_prefill_size, cfg.max_running_requests)
        )
        self.runner = ModelRunner(self.model, self.pool, self.device, cfg.seed)
        self.eos_token_ids = self._eos_ids(Path(cfg.model))
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = 0
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- called from any thread -------------------------------------------------------------

    def submit(
        self, req: GenerateRequest, sink: Callable[[RequestOutput], None]
    ) -> Admitted | Rejected:
        """Admission runs here, in the caller's thread: a Rejected never reaches the loop."""
        verdict = admit(req, self.limits)
        if isinstance(verdict, Admitted):
            self._inbox.put(("add", (verdict, sink)))
            self._wake.set()
        return verdict

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            pages_total=self.pool.num_pages,
            pages_used=self.pool.num_used,
            pages_free=self.pool.num_free,
            page_size=self.pool.page_size,
            pool_tokens=self.pool.capacity_tokens,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.num_preemptions,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvfence-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the loop (engine thread only) ------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if not self.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
            try:
                self.step()
            except Exception:
                log.exception("engine step failed; failing the running requests closed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, "internal engine error", "engine_error")

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> None:
        self._drain_inbox()
        chunks = self.scheduler.schedule()
        if not chunks:
            return
        result = self.runner.run(chunks)
        self._postprocess(chunks, result)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                admitted, sink = payload  # type: ignore[misc]
                self._add(admitted, sink)
            elif kind == "abort":
                seq = self._seqs.get(payload)  # type: ignore[arg-type]
                if seq is not None:
                    self._finish(seq, FinishReason.ABORT)

    def _add(self, admitted: Admitted, sink: Callable[[RequestOutput], None]) -> None:
        req = admitted.request
        gen = None
        if req.sampling.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(req.sampling.seed)
        self._arrivals += 1
        seq = Sequence(admitted, sink, self._arrivals, IncrementalDetokenizer(self.tokenizer), gen)
        if req.request_id in self._seqs:
            sink(
                self._output(
                    seq, [], FinishReason.ERROR, "duplicate request id", "duplicate_request_id"
                )
            )
            return
        self._seqs[req.request_id] = seq
        self.scheduler.add(seq)

    def _postprocess(self, chunks: list, result: StepResult) -> None:
        for chunk in chunks:
            chunk.seq.num_computed = chunk.start + chunk.length
        for chunk in result.rejected:
            log.error(
                "kv ownership check failed: tenant=%s request=%s pages=%s",
                chunk.seq.tenant,
                chunk.seq.request_id,
                chunk.seq.pages,
            )
            self._finish(
                chunk.seq,
                FinishReason.ERROR,
                "KV cache integrity check failed",
                "kv_integrity_error",
                pages_suspect=True,
            )
        if result.samples is None:
            return
        s = result.samples
        token_ids = s.token_ids.tolist()
        for i, chunk in enumerate(result.sampled):
            seq = chunk.seq
            if seq.status is SeqStatus.FINISHED:
                continue
            tok = token_ids[i]
            seq.token_ids.append(tok)
            if seq.admitted.request.sampling.logprobs is not None:
                seq.pending_logprobs.append(
                    _logprob(s, i, tok, seq.admitted.request.sampling.logprobs)
                )
            self._advance(seq, tok)

    def _advance(self, seq: Sequence, tok: int) -> None:
        sp = seq.admitted.request.sampling
        reason: FinishReason | None = None
        if (tok in self.eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
            reason = FinishReason.STOP
            new_text = seq.detok.flush(seq.output_ids[:-1])
        else:
            new_text = seq.detok.step(seq.output_ids)
        seq.text += new_text
        if sp.stop:
            hit = _find_stop(seq.text, seq.sent_text_len, new_text, sp.stop)
            if hit is not None:
                seq.text = seq.text[:hit]
                reason = FinishReason.STOP
        if reason is None and seq.num_output >= seq.admitted.max_tokens:
            reason = FinishReason.LENGTH
            seq.text += seq.detok.flush(seq.output_ids)
        if reason is not None:
            self._finish(seq, reason)
            return
        # Hold back text that could still become a stop string.
        hold = max((len(x) for x in sp.stop), default=1) - 1
        self._emit(seq, max(seq.sent_text_len, len(seq.text) - hold), None)

    def _emit(
        self,
        seq: Sequence,
        upto: int,
        reason: FinishReason | None,
        error: str | None = None,
        code: str | None = None,
    ) -> None:
        text = seq.text[seq.sent_text_len : upto]
        seq.sent_text_len = max(seq.sent_text_len, upto)
        new_ids = seq.output_ids[seq.sent_ids :]
        seq.sent_ids = seq.num_output
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        if not text and not new_ids and reason is None:
            return
        seq.sink(
            RequestOutput(
                request_id=seq.request_id,
                new_token_ids=tuple(new_ids),
                new_text=text,
                finish_reason=reason,
                prompt_tokens=seq.prompt_len,
                completion_tokens=seq.num_output,
                logprobs=tuple(logprobs),
                error=error,
                error_code=code,
            )
        )

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: str | None = None,
        code: str | None = None,
        pages_suspect: bool = False,
    ) -> None:
        """End seq exactly once (I5): return its pages, then send the final output."""
        if seq.status is SeqStatus.FINISHED:
            return
        self.scheduler.remove(seq, pages_suspect)
        self._seqs.pop(seq.request_id, None)
        seq.finish_reason = reason
        self._emit(seq, len(seq.text), reason, error, code)

    def _output(
        self, seq: Sequence, ids: list[int], reason: FinishReason, error: str, code: str
    ) -> RequestOutput:
        return RequestOutput(
            seq.request_id, tuple(ids), "", reason, seq.prompt_len, 0, (), error, code
        )

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids = set(self.model_config.eos_token_ids) | self.tokenizer.eos_token_ids
        gen_cfg = model_dir / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        return frozenset(ids)


def _logprob(s, i: int, tok: int, k: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if k > 0 and s.top_ids is not None:
        top = tuple(zip(s.top_ids[i, :k].tolist(), s.top_logprobs[i, :k].tolist(), strict=True))
    return TokenLogprob(tok, float(s.chosen_logprobs[i]), top)


def _find_stop(text: str, sent: int, new_text: str, stops: tuple[str, ...]) -> int | None:
    """Earliest stop-string start in the not-yet-sent tail of text, or None."""
    window_start = max(sent, len(text) - len(new_text) - max(len(x) for x in stops))
    best: int | None = None
    for stop in stops:
        pos = text.find(stop, max(0, window_start))
        if pos != -1 and (best is None or pos < best):
            best = pos
    return best
