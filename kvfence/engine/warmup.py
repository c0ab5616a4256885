"""Boot warm-up: a few steps through the engine's own runner before a server reports ready, so
the step-cost fit (kvfence/engine/step_budget.py) exists from the first request on.

Without it a fresh server's first steps price nothing: `StepCostModel.cost()` is None until
MIN_SAMPLES steps were seen, so a wave gives no early first tokens (kvfence/engine/waves.py)
and a mixed step takes the minimum chunk; and the very first steps of a process pay one-time
costs (allocator growth, kernel JIT, oneDNN primitives, the OpenMP pool of the loop's thread)
that a client's first request would otherwise pay. Like vLLM's profile run before it reports
ready, the engine computes a handful of prefill chunks and decode steps at a few row counts,
drops the first COLD_STEPS, and hands the rest to the step-cost model as seeds: they are its
fit until MIN_SAMPLES real steps can fit alone (a warm-up timed on a busy host would otherwise
price the first waves until the window pushed it out).

Safety: the warm-up's rows belong to WARMUP_TENANT, a name outside the tenant alphabet that no
credential can map to (kvfence/server/auth.py), with no prefix-cache chain, so nothing they
compute is looked up or sealed; their pages come from and go back through the pool's and the
scheduler's own paths (poisoning on free included); they never enter the scheduler's queues,
the engine's requests or any sink, so no metric, usage or output sees them. The pool must be
exactly as it was afterwards (no page held, nothing cached), else the engine refuses to start:
a page kept here would shrink the capacity the boot check (I7) vouched for.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Protocol

from kvfence.config import EngineConfig
from kvfence.engine.admission import Admitted
from kvfence.engine.request import GenerateRequest, SamplingParams
from kvfence.engine.runner import ModelRunner
from kvfence.engine.scheduler import ScheduledChunk, Scheduler
from kvfence.engine.sequence import SeqMode, SeqStatus, Sequence
from kvfence.engine.step_budget import MIN_SAMPLES
from kvfence.faults import Faults
from kvfence.kv.pool import KVPool
from kvfence.model.config import ModelConfig

log = logging.getLogger("kvfence.engine")

# '<' is outside the tenant alphabet (server/auth.py): no API key file can name this tenant.
WARMUP_TENANT = "<warm-up>"
COLD_STEPS = 2  # the first prefill and the first decode pay the process's one-time costs
ROW_COUNTS = (1, 8, 32)  # decode rows per step (capped by --max-running-requests and the pool)
MIXED_CHUNK = 128  # prefill tokens of a step that also decodes (capped by the chunk size)
# A model this size or larger computes the whole plan (a page per row, MIXED_CHUNK); a smaller
# one its prompts' tokens in proportion, and one under FIT_SCALE of it (the test and demo
# models, a few million parameters) nothing: a fit of steps that take a millisecond buys
# nothing, and a test suite starts many servers (two one-token steps still cost a median
# 170 ms an engine on 2 oversubscribed cores, each parallel region waiting for a worker). At
# 135M parameters a prompt token is what the fit must see (fp32: ~1 ms a token, ~15 ms a step).
FULL_PLAN_PARAMS = 100_000_000
FIT_SCALE = 0.05
MIN_MIXED = 8
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
clock = time.perf_counter  # what a step is timed by (a test's fake clock replaces it)


class WarmupError(RuntimeError):
    """The warm-up left the pool other than it found it: the engine must not start."""


@dataclass(frozen=True)
class WarmupPlan:
    """What the warm-up computes: `rows` decode rows, each with a prompt of `row_prompt` tokens,
    and steps of (prefill tokens, decode rows) after the rows' prompts."""

    rows: int
    row_prompt: int
    steps: tuple[tuple[int, int], ...]

    @property
    def decode_steps(self) -> int:
        return len(self.steps) + 1  # the cold decode step too

    def pages(self, pool: KVPool) -> int:
        """The most pages held at once: every row at its longest, and one mixed prompt."""
        row = pool.pages_for(self.row_prompt + self.decode_steps + 1)
        mixed = max((p for p, _ in self.steps), default=0)
        return self.rows * row + pool.pages_for(mixed + 1)


def plan(
    pool: KVPool, chunk: int, max_running: int, context_length: int, scale: float = 1.0
) -> WarmupPlan | None:
    """The steps for this pool and these limits, prompts `scale` (0..1] of their full size;
    None when the model is too small to be worth it or not even one row fits."""
    if scale < FIT_SCALE:
        return None
    row_prompt = max(1, round(pool.page_size * scale))
    mixed = min(max(MIN_MIXED, round(MIXED_CHUNK * scale)), chunk, context_length - 1)
    for rows in range(min(max(ROW_COUNTS), max_running), 0, -1):
        counts = sorted({min(n, rows) for n in ROW_COUNTS})
        grid = [(p, d) for d in counts for p in (0, mixed)]
        # The rows' own prompts are one measured step; the grid repeats until the fit has
        # MIN_SAMPLES steps to read.
        steps = [grid[i % len(grid)] for i in range(max(len(grid), MIN_SAMPLES - 1))]
        candidate = WarmupPlan(rows, row_prompt, tuple(steps))
        fits_context = row_prompt + candidate.decode_steps + 1 <= context_length
        if fits_context and candidate.pages(pool) <= pool.num_free:
            return candidate
    return None


def warmup_tokens(vocab_size: int, n: int, salt: int) -> list[int]:
    """A warm-up prompt: any tokens will do for timing; these are fixed, so a test can send a
    tenant request made of the same tokens."""
    return [(7 + 31 * j + 101 * salt) % vocab_size for j in range(n)]


class Booting(Protocol):
    """What the warm-up reads of the engine it warms (kvfence/engine/engine.py's Engine, which
    calls it; named by its parts so this module does not import the engine's)."""

    cfg: EngineConfig
    model_config: ModelConfig
    context_length: int
    runner: ModelRunner
    scheduler: Scheduler
    faults: Faults


def boot(engine: Booting, booted: queue.SimpleQueue[BaseException | None]) -> bool:
    """On the loop's thread, before its first step: the warm-up if --boot-warmup, then word to
    Engine.start (None, or what failed, which start raises in its caller's thread). False: the
    loop must not run."""
    try:
        if engine.cfg.boot_warmup:
            vocab, context = engine.model_config.vocab_size, engine.context_length
            t0 = time.perf_counter()
            scale = model_scale(engine.model_config)
            n = warm_up(engine.runner, engine.scheduler, vocab, context, engine.faults, scale)
            log.info("warm-up: %d steps measured, %.0f ms", n, (time.perf_counter() - t0) * 1e3)
    except BaseException as e:  # noqa: BLE001 - the caller's thread raises it
        booted.put(e)
        return False
    booted.put(None)
    return True


def model_scale(config: ModelConfig) -> float:
    """The share of the full plan's prompt tokens a model computes: the parameters one token's
    forward reads, from the shapes (a packed or sharded model's tensors no longer show them),
    against FULL_PLAN_PARAMS."""
    return min(1.0, config.num_active_params / FULL_PLAN_PARAMS)


def warm_up(
    runner: ModelRunner,
    scheduler: Scheduler,
    vocab_size: int,
    context_length: int,
    faults: Faults,
    scale: float = 1.0,
) -> int:
    """Run the warm-up (prompts `scale` of their full size) and feed its steps to the
    scheduler's step-cost model. Returns the steps measured (0: the pool is too small to warm
    up in). Raises WarmupError when the pool is not as it was afterwards."""
    pool = scheduler.pool
    limits = scheduler.limits
    steps = plan(
        pool, limits.chunked_prefill_size, limits.max_running_requests, context_length, scale
    )
    if steps is None:
        if scale >= FIT_SCALE:
            log.warning("warm-up skipped: the pool cannot hold its rows")
        return 0
    free, cached = pool.num_free, pool.num_cached
    held: list[Sequence] = []
    try:
        measured = _run(runner, scheduler, steps, vocab_size, held)
        scheduler.step_budget.publish_fit()
    finally:
        for seq in faults.hook("warmup_keeps_pages", held):
            scheduler.release(seq)
    if faults.guards().on("warmup_returned") and (
        pool.num_free != free or pool.num_cached != cached
    ):
        raise WarmupError(
            f"warm-up left the pool changed ({free - pool.num_free} pages held, "
            f"{pool.num_cached - cached} cached): refusing to start"
        )
    return measured


def _run(
    runner: ModelRunner,
    scheduler: Scheduler,
    steps: WarmupPlan,
    vocab_size: int,
    held: list[Sequence],
) -> int:
    rows = [_sequence(scheduler, steps.row_prompt, vocab_size, i, held) for i in range(steps.rows)]
    # Cold: the first row's prompt, then its first decode; neither is measured.
    _step(runner, scheduler, [_whole(rows[0])], None)
    _step(runner, scheduler, [_next(rows[0])], None)
    measured = 0
    rest = [_whole(s) for s in rows[1:]]
    if rest:  # the other rows' prompts beside the first row's decode, a chunk at a time
        chunk = scheduler.limits.chunked_prefill_size
        while rest:
            take, size = [], 0
            while rest and size + rest[0].length <= chunk:
                size += rest[0].length
                take.append(rest.pop(0))
            if not take:  # a row's prompt alone is longer than a chunk: cannot happen (a page)
                raise WarmupError("a warm-up prompt exceeds --chunked-prefill-size")
            _step(runner, scheduler, [_next(rows[0]), *take], scheduler)
            measured += 1
    for n, (prefill, decode) in enumerate(steps.steps):
        chunks = [_next(s) for s in rows[:decode]]
        if prefill:
            prompt = _sequence(scheduler, prefill, vocab_size, steps.rows + n, held)
            chunks.append(_whole(prompt))
        _step(runner, scheduler, chunks, scheduler)
        measured += 1
        if prefill:
            held.remove(prompt)
            scheduler.release(prompt)
    return measured


def _sequence(
    scheduler: Scheduler, n: int, vocab_size: int, salt: int, held: list[Sequence]
) -> Sequence:
    """A warm-up row: WARMUP_TENANT's, no prefix chain (never looked up, never sealed), a sink
    that drops everything (it is never called: the warm-up emits nothing)."""
    rid = f"warm-up-{salt}"
    req = GenerateRequest(rid, WARMUP_TENANT, tuple(warmup_tokens(vocab_size, n, salt)), GREEDY)
    seq = Sequence(Admitted(req, 1), lambda _out: None, SeqMode.FULL, None)  # type: ignore[arg-type]
    pool = scheduler.pool
    seq.grant = pool.new_grant(WARMUP_TENANT, rid)
    held.append(seq)
    seq.pages = pool.allocate(seq.grant, pool.pages_for(n))
    seq.status = SeqStatus.RUNNING
    return seq


def _whole(seq: Sequence) -> ScheduledChunk:
    return ScheduledChunk(seq, 0, len(seq.token_ids))


def _next(seq: Sequence) -> ScheduledChunk:
    """seq's next decode token (_step gives it a page)."""
    return ScheduledChunk(seq, seq.num_computed, 1)


def _step(
    runner: ModelRunner,
    scheduler: Scheduler,
    chunks: list[ScheduledChunk],
    measure: Scheduler | None,
) -> None:
    """One step through the runner, timed as the engine times its steps (the forward, the
    sample and its tokens read back); measured only when `measure` is given."""
    for c in chunks:
        _ensure_page(scheduler.pool, c)
    decode_rows = sum(c.seq.in_decode for c in chunks)
    prefill_tokens = sum(c.length for c in chunks if not c.seq.in_decode)
    t0 = clock()
    result = runner.run(chunks)
    if result.rejected:
        raise WarmupError("a warm-up row failed the ownership check")
    tokens = result.samples.token_ids.tolist() if result.samples is not None else []
    ms = (clock() - t0) * 1000
    for c in chunks:
        c.seq.num_computed = c.start + c.length
    for c, tok in zip(result.sampled, tokens, strict=True):
        c.seq.token_ids.append(tok)
    if measure is not None:
        measure.step_budget.seed(prefill_tokens, decode_rows, ms)


def _ensure_page(pool: KVPool, chunk: ScheduledChunk) -> None:
    seq = chunk.seq
    need = pool.pages_for(chunk.start + chunk.length) - len(seq.pages)
    if need > 0:
        assert seq.grant is not None
        seq.pages.extend(pool.allocate(seq.grant, need))
