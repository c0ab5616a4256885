"""The step-time budget: how many prefill tokens a step that also decodes may carry.

A decode step's time is every running stream's inter-token latency (ITL). A prompt chunk that
rides in the same step lengthens it by roughly its tokens times the cost of one prefill token,
so the budget follows from a step-time target instead of a fixed token count:

    step_ms ~= a + b * prefill_tokens + c * decode_rows          (StepCost)

fit online on the engine's recent steps (StepCostModel: least squares with the coefficients
kept non-negative, then refit without the steps whose residual is far out: a step slowed by a
neighbour's burst of work must not shrink every later budget). The target is either absolute
(`--max-decode-step-ms`) or, by default, AUTO_STEP_FACTOR times the predicted decode-only step of
the rows now running, which keeps the budget the same whatever the hardware or the machine's
load (both sides of the ratio slow down together). A step with no decode is not bounded here:
it takes the whole `--chunked-prefill-size`.

Two floors keep prompts moving (the TTFT side). A minimum chunk, when the target leaves no
room. And the backlog: a step takes at least 1/`--prefill-backlog-steps` of the prompt tokens
waiting to be computed. Without it the auto target feeds on itself under load: prompts queue,
fewer streams decode, the decode step gets shorter, so does the budget, and more prompts queue;
with it a burst drains in about that many steps and the decode batch stays full.
`--decode-step-prefill-budget` stays a hard cap on top of everything.

A third floor follows demand rather than the queue: the prompt tokens arriving per step, a
moving average (ArrivalPace), times `--prefill-pace`. The backlog floor alone is a proportional
controller: it only grows a chunk once prompts have queued, so under a steady stream of arrivals
chunks swing between the minimum and a burst's share, and the big ones are the ITL tail. A chunk
sized from the arrival rate stays about the same size every step (smooth ITL) and still keeps up
(no starvation at high concurrency), leaving the backlog floor to drain bursts only.

With latency targets (`--target-tpot-ms`, `--target-ttft-ms`) the time target and a fourth
floor come from where the decoding streams and the waiting prompts stand against them
(kvfence/engine/deadlines.py): the step's time is the tightest stream's slack, the floor the
tokens that keep every waiting prompt on time.

Tokens served from the prefix cache are never computed, so they never count: the scheduler
charges a chunk's computed tokens only. This module is arithmetic only (no clock, no engine):
the engine measures steps and feeds them in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import product

from kvfence.engine.deadlines import tpot_step_ms, ttft_floor

# The default target: a step that decodes may take this many times the decode-only step of the
# same rows (measured: benchmarks/RESULTS.md "HTTP: TTFT and ITL", ITL p99 vs throughput and
# TTFT).
AUTO_STEP_FACTOR = 2.0
# ... up to NARROW_ROWS decode rows; from WIDE_ROWS rows on, BudgetPolicy.wide_factor (linear
# between). A wide batch's decode-only step is already long and the prompts arriving behind it
# need more prefill per step than 2x leaves room for: at 32 rows 2x gave ~105 prefill tokens
# per 165 ms step, fewer than a closed loop's arrivals, so prompts queued for seconds
# (benchmarks/RESULTS.md "HTTP: TTFT and ITL").
NARROW_ROWS = 8
WIDE_ROWS = 32
# A decode worker that takes prompts (held_to_tpot): its floors may lengthen a step to this many
# TPOT targets, no more. Unbounded, they made 1P1D's C=32 steps 150-650 ms beside 5-28 rows
# (decode-only 50-170 ms) on 2 loaded cores: every stream's TPOT 150-260 ms at a 50 ms target,
# none within 100 ms, for local prompts that were late anyway. Held to one target, the C=8 local
# prompts lost their chunks (TTFT p50 1.97 s against 0.85, goodput at 2 s x 100 ms 0.87 against
# 1.75 req/s, interleaved); at C=8 the floors' steps stay within two (TPOT p50 47-58 ms).
HELD_FLOOR_TARGETS = 2.0
WINDOW = 64  # recent steps the fit reads
MIN_SAMPLES = 8  # below this the model does not predict; mixed steps take the minimum chunk
REFIT_EVERY = 4  # steps between fits (a fit is a few 3x3 solves; cheap, but not free)
OUTLIER_MADS = 4.0  # a step whose residual is this many MADs out is left out of the refit
PACE_HALF_LIFE_STEPS = 32  # the arrival rate's memory: a burst counts half after this many steps


@dataclass(frozen=True)
class StepCost:
    """step_ms = a + b * prefill_tokens + c * decode_rows; every coefficient >= 0."""

    a: float
    b: float
    c: float

    def predict(self, prefill_tokens: int, decode_rows: int) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_rows


@dataclass(frozen=True)
class BudgetPolicy:
    """The flags behind the budget. max_decode_step_ms: None = auto (`auto_factor` x the
    decode-only step), 0 = no time bound (the token cap alone, as before this policy)."""

    max_chunk: int  # --chunked-prefill-size: the most any step computes
    min_chunk: int  # --min-prefill-chunk: a mixed step's floor, so prefills never starve
    max_decode_step_ms: float | None = None
    token_cap: int | None = None  # --decode-step-prefill-budget: a hard cap in mixed steps
    backlog_steps: int | None = None  # --prefill-backlog-steps: drain the backlog in about this
    pace: float = 0.0  # --prefill-pace: take this times the arrival rate (0: no such floor)
    wide_factor: float = AUTO_STEP_FACTOR  # --wide-step-factor: the auto factor at WIDE_ROWS
    # --target-tpot-ms / --target-ttft-ms (kvfence/engine/deadlines.py): None, not held
    target_tpot_ms: float | None = None
    target_ttft_ms: float | None = None
    ttft_cuts: bool = False  # --ttft-cuts: a wave too big for the TTFT target is cut (waves.py)
    # A decode worker that takes prompts beside its rows (kvfence/pd/local_prefill.py): its
    # floors are held within HELD_FLOOR_TARGETS TPOT targets (Scheduler.share_prompts).
    tpot_over_floors: bool = False


@dataclass(frozen=True)
class Deadlines:
    """What the scheduler measured against the targets this step: the tightest decoding
    stream's slack (ms), and the waiting prompts in serving order as (tokens to compute up to
    and including it, ms left to its TTFT target). None / empty: no such target. tpot_lost:
    every decoding stream has lost its TPOT target (deadlines.tpot_lost)."""

    tpot_slack_ms: float | None = None
    prompts: tuple[tuple[int, float], ...] = ()
    tpot_lost: bool = False


def auto_factor(policy: BudgetPolicy, decode_rows: int) -> float:
    """The auto target's multiple of the decode-only step for this many decode rows."""
    share = min(1.0, max(0.0, (decode_rows - NARROW_ROWS) / (WIDE_ROWS - NARROW_ROWS)))
    return AUTO_STEP_FACTOR + share * (policy.wide_factor - AUTO_STEP_FACTOR)


def prefill_budget(
    policy: BudgetPolicy,
    cost: StepCost | None,
    decode_rows: int,
    backlog: int = 0,
    arrival_rate: float = 0.0,
    deadlines: Deadlines | None = None,
) -> int:
    """Prefill tokens a step with `decode_rows` decodes may add, `backlog` prompt tokens waiting
    to be computed, `arrival_rate` prompt tokens arriving per step. The floors (minimum chunk,
    share of the backlog, pace of arrivals, the prompts' TTFT deadlines) win over the time
    target (prefills progress), the token cap over everything (an operator's hard limit).
    With a TPOT target the time target is the decoding streams' slack (deadlines.py), and an
    absolute --max-decode-step-ms still bounds it."""
    cap = policy.max_chunk if policy.token_cap is None else min(policy.token_cap, policy.max_chunk)
    if decode_rows == 0:
        return policy.max_chunk
    if policy.max_decode_step_ms == 0:
        return cap
    floor = policy.min_chunk
    if policy.backlog_steps:
        floor = max(floor, -(-backlog // policy.backlog_steps))
    if policy.pace > 0 and arrival_rate > 0:
        floor = max(floor, math.ceil(policy.pace * arrival_rate))
    floor = min(floor, cap)
    if cost is None or cost.b <= 0:
        return floor  # nothing measured yet: the smallest step that still makes progress
    decode_ms = cost.predict(0, decode_rows)
    target = step_target_ms(policy, decode_rows, decode_ms, deadlines)
    room = (target - decode_ms) / cost.b
    tokens = math.floor(room) if math.isfinite(room) else cap
    if deadlines is not None and deadlines.prompts:
        floor = max(floor, ttft_floor(decode_ms, cost.b, deadlines.prompts, cap))
    if held_to_tpot(policy, deadlines):
        assert policy.target_tpot_ms is not None
        ceiling = (HELD_FLOOR_TARGETS * policy.target_tpot_ms - decode_ms) / cost.b
        floor = min(floor, max(1, math.floor(ceiling)))
    return max(floor, min(cap, tokens))


def held_to_tpot(policy: BudgetPolicy, deadlines: Deadlines | None) -> bool:
    """Whether the floors (the minimum chunk, the prompts' TTFT) may lengthen a step to
    HELD_FLOOR_TARGETS TPOT targets at most (one prompt token at least, so a prompt already
    here still moves): a decode worker that takes prompts (BudgetPolicy.tpot_over_floors) with
    a TPOT target."""
    return policy.tpot_over_floors and policy.target_tpot_ms is not None and deadlines is not None


def step_target_ms(
    policy: BudgetPolicy, decode_rows: int, decode_ms: float, deadlines: Deadlines | None
) -> float:
    """How long a step that decodes may take: the TPOT target's slack when one is set, the
    absolute --max-decode-step-ms when given (the smaller of the two when both), else the auto
    multiple of the decode-only step.

    Once every decoding stream has lost its TPOT target (Deadlines.tpot_lost) the target bounds
    nothing and the step is sized as without it, unless prompts have somewhere else to go (a
    decode worker's held steps: the prefill worker). Why: held to the decode-only step, such
    steps left the prompts the floors' tokens only (the minimum chunk beside 31 rows), so a
    prompt arriving beside lost streams waited ~13 steps for its first token while their TPOT
    came out the same (the prompt's compute lands in their life whatever its chunks). fp32
    C=32, 256 -> 64 on EPYC (a 77 ms decode step at a 50 ms target), diag through goodput.py's
    client, the same 4 seeds each: the first prompt of the closed loop's second round at
    0.48-0.51 s instead of 0.67-1.31 (vLLM's 0.49-0.53), 1 s x 200 ms goodput 0.04-0.13 req/s
    against 0-0.04, TTFT p50 3.4-3.7 s against 3.8-4.1, throughput 630-640 tok/s against
    619-654. bf16 C=32 (a ~45 ms decode step), interleaved, 2 x 2 passes: 4 s x 50 ms 0.58-1.16
    against 0.57-1.17 req/s, throughput 1,122-1,218 against 1,089-1,139 (noise-bound)."""
    targets = []
    if policy.max_decode_step_ms is not None:
        targets.append(policy.max_decode_step_ms)
    lost = deadlines is not None and deadlines.tpot_lost and not policy.tpot_over_floors
    if policy.target_tpot_ms is not None and deadlines is not None and not lost:
        slack = deadlines.tpot_slack_ms
        slack = policy.target_tpot_ms if slack is None else slack
        targets.append(tpot_step_ms(policy.target_tpot_ms, slack, decode_ms))
    if not targets:
        return auto_factor(policy, decode_rows) * decode_ms
    return min(targets)


def fit_nonnegative(rows: list[tuple[int, int, float]]) -> StepCost | None:
    """Least squares of ms on (1, prefill, decode rows) with every coefficient >= 0: the best
    of the 7 fits on each non-empty subset of free coefficients (others held at 0) whose result
    is non-negative. None when nothing fits (no rows, or no positive cost per prefill token can
    be told from them). Reads the rows once, into the normal equations' moments."""
    xtx = [[0.0] * 3 for _ in range(3)]
    xty = [0.0] * 3
    yty = 0.0
    for p, d, ms in rows:
        x = (1.0, float(p), float(d))
        for r in range(3):
            xty[r] += x[r] * ms
            for c in range(3):
                xtx[r][c] += x[r] * x[c]
        yty += ms * ms
    best: tuple[float, tuple[float, ...]] | None = None
    for free in product((True, False), repeat=3):
        idx = [i for i in range(3) if free[i]]
        coef = _solve(xtx, xty, idx) if idx else None
        if coef is None or min(coef) < 0:
            continue
        theta = [0.0, 0.0, 0.0]
        for i, v in zip(idx, coef, strict=True):
            theta[i] = v
        quad = sum(theta[r] * xtx[r][c] * theta[c] for r in range(3) for c in range(3))
        sse = yty - 2 * sum(t * v for t, v in zip(theta, xty, strict=True)) + quad
        if best is None or sse < best[0]:
            best = (sse, tuple(theta))
    if best is None or best[1][1] <= 0:
        return None
    a, b, c = best[1]
    return StepCost(a, b, c)


def _solve(xtx: list[list[float]], xty: list[float], idx: list[int]) -> list[float] | None:
    """The normal equations restricted to the columns idx (Gaussian elimination with partial
    pivoting; None when singular: that coefficient cannot be told from these steps)."""
    n = len(idx)
    m = [[xtx[r][c] for c in idx] + [xty[r]] for r in idx]
    scale = max(abs(m[r][r]) for r in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-9 * scale:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[r][n] / m[r][r] for r in range(n)]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def fit_robust(rows: list[tuple[int, int, float]]) -> StepCost | None:
    """fit_nonnegative, then again without the steps whose residual lies more than
    OUTLIER_MADS median absolute deviations from the median residual."""
    first = fit_nonnegative(rows)
    if first is None:
        return None
    res = [ms - first.predict(p, d) for p, d, ms in rows]
    med = _median(res)
    mad = _median([abs(r - med) for r in res])
    if mad <= 0:
        return first
    kept = [row for row, r in zip(rows, res, strict=True) if abs(r - med) <= OUTLIER_MADS * mad]
    return fit_nonnegative(kept) or first


class StepCostModel:
    """The engine's recent steps and the StepCost fit on them (refit every REFIT_EVERY steps).
    Seeds (the boot warm-up's steps, kvfence/engine/warmup.py) stand in until MIN_SAMPLES real
    steps were seen, then leave the fit at once: a warm-up timed while the host was busy (a
    peer booting beside it) fitted a = 1,068 ms, and as window samples that fit would have
    priced the first waves until 64 real steps pushed it out."""

    def __init__(self, window: int = WINDOW) -> None:
        self.steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self.seeds: list[tuple[int, int, float]] = []
        self._since_fit = 0
        self._cost: StepCost | None = None

    def observe(self, prefill_tokens: int, decode_rows: int, ms: float) -> None:
        if _sample(prefill_tokens, decode_rows, ms):
            self.steps.append((prefill_tokens, decode_rows, ms))
            self._since_fit += 1
            if len(self.steps) == MIN_SAMPLES and self.seeds:
                self._cost = None  # the first fit of real steps alone replaces the seeded one

    def seed(self, prefill_tokens: int, decode_rows: int, ms: float) -> None:
        """A step measured before any real one, fit only until real steps can fit alone."""
        if _sample(prefill_tokens, decode_rows, ms):
            self.seeds.append((prefill_tokens, decode_rows, ms))
            self._cost = None

    def cost(self) -> StepCost | None:
        """The current fit; None until MIN_SAMPLES steps (seeds included) were seen."""
        alone = len(self.steps) >= MIN_SAMPLES
        if not alone and len(self.steps) + len(self.seeds) < MIN_SAMPLES:
            return None
        if self._cost is None or self._since_fit >= REFIT_EVERY:
            # The window is copied only to refit: cost() is read several times a step.
            samples = list(self.steps) if alone else self.seeds + list(self.steps)
            self._cost = fit_robust(samples) or self._cost
            self._since_fit = 0
        return self._cost


def _sample(prefill_tokens: int, decode_rows: int, ms: float) -> bool:
    """A step the fit can read: it computed something, in a finite non-negative time."""
    return (prefill_tokens or decode_rows) > 0 and math.isfinite(ms) and ms >= 0


class ArrivalPace:
    """Prompt tokens arriving per scheduled step: an exponentially weighted mean, updated once
    per step with what arrived since the last one."""

    def __init__(self, half_life_steps: float = PACE_HALF_LIFE_STEPS) -> None:
        self.alpha = 1.0 - 0.5 ** (1.0 / half_life_steps)
        self.rate = 0.0
        self._pending = 0

    def arrive(self, tokens: int) -> None:
        self._pending += tokens

    def tick(self) -> float:
        self.rate += self.alpha * (self._pending - self.rate)
        self._pending = 0
        return self.rate


class StepBudget:
    """What the scheduler asks (the prefill budget of a step) and tells (prompt tokens that
    arrived), and the engine tells (how long a step took)."""

    def __init__(self, policy: BudgetPolicy, model: StepCostModel | None = None) -> None:
        self.policy = policy
        self.model = model if model is not None else StepCostModel()
        self.pace = ArrivalPace()
        self._beside: tuple[StepCost, int] | None = None

    def arrive(self, prompt_tokens: int) -> None:
        self.pace.arrive(prompt_tokens)

    def for_step(
        self, decode_rows: int, backlog: int = 0, deadlines: Deadlines | None = None
    ) -> int:
        """Called once per step (it also advances the arrival rate)."""
        rate = self.pace.tick()
        cost = self.model.cost()
        if cost is not None:
            self._beside = (cost, decode_rows)
        return prefill_budget(self.policy, cost, decode_rows, backlog, rate, deadlines)

    def beside(self) -> tuple[StepCost, int] | None:
        """The last step's fitted cost and decode rows: what a prompt computed in these steps
        is priced by (kvfence/pd/local_prefill.py). None until a fit exists. Any thread may read
        it: one attribute, replaced whole."""
        return self._beside

    def publish_fit(self) -> None:
        """The model's fit, if it has one, becomes what beside() reports, with no rows: after a
        boot warm-up (kvfence/engine/warmup.py) a PD decode prices its first prompts by it."""
        cost = self.model.cost()
        if cost is not None:
            self._beside = (cost, 0)

    def at_target(self, cost: StepCost, decode_rows: int) -> int:
        """The prefill tokens the time target alone gives a step of `decode_rows` decodes (no
        floor: a floor follows the queue, not the step's time); held to a TPOT target, that
        target's step (no stream's slack known: a whole target)."""
        held = Deadlines() if self.policy.tpot_over_floors else None
        return prefill_budget(self.policy, cost, decode_rows, deadlines=held)

    def observe(self, prefill_tokens: int, decode_rows: int, ms: float) -> None:
        self.model.observe(prefill_tokens, decode_rows, ms)

    def seed(self, prefill_tokens: int, decode_rows: int, ms: float) -> None:
        self.model.seed(prefill_tokens, decode_rows, ms)
