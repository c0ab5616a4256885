"""Waves: with both latency targets set (`--target-tpot-ms`, `--target-ttft-ms`), prompts are
computed while no stream decodes, as a group, and their first tokens come out together, so a
stream's time per output token is its decode steps alone and the prompts' compute lands in
their time to first token, the target that has room for it. Arithmetic only: the scheduler
(kvfence/engine/scheduler.py) hands in the fitted step cost, the streams' remaining tokens and
the prompts' deadlines, and asks which mode the step is in.

Why: a stream's TPOT is (its last token - its first) / (tokens - 1), so every prompt chunk that
rides in a step while it decodes is charged to it. In a closed loop of C streams each stream
carries the other streams' replacements' prompts: at C=8, 256 -> 64 on EPYC about 8 x 360 ms
of prefill beside 64 decode steps of ~35 ms, a TPOT of (2.9 s + 2.2 s) / 63 = 81 ms whatever
the chunk size (measured 62-67 ms: TPOT p50 67 ms against vLLM's 44, and 62 ms with a 50 ms
target, which the step budget's floors overrule). A target of 50 ms leaves each stream
63 x (50 - 35) = 945 ms of others' prefill in its whole life, less than three prompts, so the
target can only be held if prompts are computed when nobody decodes: vLLM's closed loop does
this by accident (its waves prefill together, TTFT p50 2.4 s, TPOT 44 ms); SGLang runs a
prefill batch before decodes; Sarathi-Serve's stall-free batching takes the opposite side
(every step decodes, chunks sized to the TBT target), which is what the step budget does when
the waves cannot keep the TTFT target.

The modes of a step:
- FILL: no stream outside the wave decodes: whole chunks (no decode row bounds the budget),
  the waiting prompts join, and every prompt keeps its last token uncomputed (it is "held": the
  step that computes it samples the first token) except the wave's leader, the first to finish,
  whose first token comes at once; the leader then waits for the wave (one long gap, its TPOT
  ~ (fill + 63 decode steps) / 63, ~75 ms at C=8) while the others get TPOT = the decode step.
  One fast first token per wave is what a TTFT target tighter than the one set asks of a few
  requests (goodput at 1 s x 100 ms), bought with one gap: the ITL tail stays the decode step.
  Once the rest of the wave is short enough for a stream to wait for it and still hold the
  TPOT target (`early_firsts`), a few held prompts get their first token early too (each one
  gap; together with the leader's under GAP_SHARE of the wave's gaps): without them the TTFT
  p50 is the whole wave's compute (C=8: 2,048 tokens, ~2.4-2.8 s, about vLLM's). The fill
  step that would pass the point where they may come stops at it (`early_rest`,
  kvfence/engine/fill.py), so they come in it rather than at the end of a whole chunk (C=8
  fp32 on EPYC, chunks of 512 tokens: ~1.9 s into a 2.5 s fill instead of the ~1.3 s their
  target allows; with half the wave early, the TTFT p50 lies between the early and the late).
- RELEASE: the wave has nothing left to compute but held tokens: one step computes them all
  and decodes the leader; from then the wave's streams decode in lockstep.
- DEFER: streams decode and every waiting prompt can still meet its TTFT target after they
  drain and a wave computes it: nothing is admitted. The drain is priced from each stream's
  max_tokens, so a stream that may run long (a request without max_tokens) lets the prompts
  beside it in as if there were no waves.
- CUT (`--ttft-cuts`, on by default): the prompts cannot all be on time in one wave (C=32,
  256 -> 64: 32 x 256 tokens at ~1 ms a token fp32 is ~8 s against a 4 s target) and mode says
  OFF: the oldest prompts that can still be on time, as many as fit CUT_SHARE of the tightest
  one's time left (`cut`), are served first in whole chunks and get their first tokens as they
  finish; the rest of each chunk computes the other prompts, which hold their first tokens
  until every prompt of the cut has one (`cut_release`: then a RELEASE step), and every stream
  decodes beside them. So the cut's streams start within the TTFT target, the others start
  together after them instead of one by one in every step's gaps, and nothing waits idle
  (the decode batch stays full: throughput is the step budget's). While a cut's streams
  decode, the step budget alone (OFF) serves the rest, and no wave forms. A prompt OVERDUE_X
  targets late goes ahead of a cut (`cut_order`): later arrivals pass it over for at most
  that long. Why: without it the step budget gave all 32 first streams TPOT 150-200 ms, so
  none met 100 ms. Measured against the step budget alone in the same passes (goodput.py's
  serve_alt side, 3 quiet passes, C=32, 48 prompts, benchmarks/RESULTS.md "Goodput against
  vLLM"): bf16 2 s x 100 ms 0.57 -> 0.74 req/s, 1 s x 100 ms 0.14 -> 0.22, TTFT p50 0.88x,
  throughput 1.03x; fp32 4 s x 100 ms 0.04 -> 0.32, TTFT p50 0.87x, throughput 1.00x
  (0.97-1.14). benchmarks/waves_cut_sim.py priced it first. C=8 never cuts (a wave of 8 fits
  the target).
- OFF: the step budget alone (kvfence/engine/step_budget.py): the wave could not keep the
  TTFT target and no prompt can still be on time (or a cut's streams still decode): the
  prompts are late either way, so mixing them with decodes at least starts the streams sooner.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable

from kvfence.engine.deadlines import OVERDUE_X
from kvfence.engine.step_budget import MIN_SAMPLES, StepCost

# At most this share of a wave's inter-token gaps may be a long one (the leader's, an early first
# token's): the ITL p99 then stays a decode step.
GAP_SHARE = 1 / 125
# An early first token's predicted TPOT stays within this share of the target: the step cost
# is a fit, and a stream that misses the target by a little is lost to goodput all the same.
# 0.9 leaves the fit 10% to be wrong by; at 0.8 only a wave's last prompt or two were released
# early, whose TTFT is nearly the whole wave's anyway (benchmarks/waves_sim.py --cost measured:
# C=8 TTFT p50 2,713 ms at 0.8, 2,381 at 0.9, every SLO cell the same).
EARLY_MARGIN = 0.9
# A cut takes prompts whose wave fits this share of the tightest one's time left (the rest of
# the time is the other prompts'): benchmarks/waves_cut_sim.py, C=32: at 0.35 bf16 lost its
# gains (2 s x 100 ms 0.75, throughput -4%); 0.7 priced like 0.5 but for fp32 "epyc" throughput.
CUT_SHARE = 0.5


class Wave(enum.Enum):
    OFF = "off"
    FILL = "fill"
    RELEASE = "release"
    DEFER = "defer"
    CUT = "cut"


def drain_ms(cost: StepCost, remaining: Iterable[int]) -> float:
    """ms until streams with these output tokens still to come have all finished, in
    decode-only steps (a step of n rows costs cost.predict(0, n); rows leave as they finish)."""
    left = sorted(r for r in remaining if r > 0)
    total, done = 0.0, 0
    for i, r in enumerate(left):
        total += (r - done) * cost.predict(0, len(left) - i)
        done = r
    return total


def fill_ms(cost: StepCost, tokens: int, chunk: int) -> float:
    """ms to compute `tokens` prompt tokens in steps of at most `chunk` with no decode rows, and
    the release step after them."""
    if tokens <= 0:
        return 0.0
    steps = -(-tokens // max(1, chunk))
    return steps * cost.a + tokens * cost.b + cost.a


def on_time(cost: StepCost, chunk: int, wait_ms: float, tokens: int, min_left_ms: float) -> bool:
    """Whether a wave of `tokens` prompt tokens, started after `wait_ms`, gives every one of its
    held first tokens within its TTFT target (`min_left_ms`: the tightest prompt's time left)."""
    return wait_ms + fill_ms(cost, tokens, chunk) <= min_left_ms


def mode(
    filling: bool,
    streams: Iterable[int],
    prompts: Iterable[tuple[int, float]],
    cost: StepCost | None,
    chunk: int,
    filled: bool,
) -> Wave:
    """The step's mode. filling: the last step was a FILL; streams: output tokens still to come
    of every stream that decodes outside the wave; prompts: (tokens to compute, ms left to its
    TTFT target) of each prompt with no first token yet, held ones included; filled: nothing of
    the wave is left to compute but held tokens, and no waiting prompt can join it."""
    left = list(streams)
    work = list(prompts)
    tokens = sum(t for t, _ in work)
    min_left = min((ms for _, ms in work), default=float("inf"))

    def fits(wait_ms: float) -> bool:
        # Before anything is measured a wave is taken to fit if its steps are no more than
        # the fit needs: a closed loop's first C prompts arrive together, and mixed they start
        # the streams staggered, which later waves cannot undo within the TTFT target (each
        # would wait for the last stream to drain); a longer wave is not started blind.
        if cost is None:
            return tokens <= MIN_SAMPLES * chunk
        return on_time(cost, chunk, wait_ms, tokens, min_left)

    if filling:
        if left or not fits(0.0):
            return Wave.OFF  # a stream from outside, or a wave too big for the target
        return Wave.RELEASE if filled else Wave.FILL
    if not work:
        return Wave.OFF
    if not left:
        return Wave.FILL if fits(0.0) else Wave.OFF
    if cost is not None and fits(drain_ms(cost, left)):
        return Wave.DEFER
    return Wave.OFF


def early_firsts(
    cost: StepCost | None,
    chunk: int,
    rest_tokens: int,
    wave_size: int,
    out_tokens: int,
    target_tpot_ms: float,
    early: int,
) -> int:
    """How many more held prompts of a filling wave may have their first token now, `early`
    having had it already (the leader aside). Each then waits for the rest of the wave
    (`rest_tokens` to compute: one long gap) and decodes `out_tokens` more at the wave's
    decode step, so it is on its TPOT target while (rest + out_tokens x step) / out_tokens
    stays within EARLY_MARGIN of it; and the wave's long gaps (the leader's and these) stay
    within GAP_SHARE of its wave_size x out_tokens gaps. Early first tokens are what bring the
    TTFT p50 below a whole wave's compute."""
    if cost is None or out_tokens <= 0:
        return 0
    gaps = math.floor(GAP_SHARE * wave_size * out_tokens) - 1 - early
    if gaps <= 0:
        return 0
    step = cost.predict(0, wave_size)
    tpot = (fill_ms(cost, rest_tokens, chunk) + out_tokens * step) / out_tokens
    return gaps if tpot <= EARLY_MARGIN * target_tpot_ms else 0


def early_rest(
    cost: StepCost | None,
    chunk: int,
    rest_tokens: int,
    wave_size: int,
    out_tokens: int,
    target_tpot_ms: float,
    early: int,
) -> int:
    """The most prompt tokens a filling wave may have left after a step for early first tokens
    to come in it (early_firsts' arguments, `rest_tokens` the most there are now); -1: none may
    at any rest (no gaps left, a TPOT target the decode step alone misses, nothing measured).
    A fill step that would pass this point stops at it (fill.Fill.stop): with whole chunks the
    early first tokens came at the end of the first chunk past it, up to a chunk later than
    their TPOT target asked (C=8, 256 -> 64, fp32 on EPYC: chunks of 512 tokens, ~0.6 s)."""

    def allowed(rest: int) -> bool:
        args = (wave_size, out_tokens, target_tpot_ms, early)
        return early_firsts(cost, chunk, rest, *args) > 0

    if not allowed(0):
        return -1
    if allowed(rest_tokens):
        return rest_tokens
    lo, hi = 0, rest_tokens  # allowed(lo), not allowed(hi): fill_ms grows with the rest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if allowed(mid) else (lo, mid)
    return lo


def cut(cost: StepCost | None, chunk: int, prompts: list[tuple[int, float]]) -> list[int]:
    """Indices of the prompts a cut takes (CUT above), prompts as mode's: the ones that can still
    be on time alone, oldest first (least time left), while a wave of them stays on time within
    CUT_SHARE of the tightest one's time left. Empty: none can (or nothing is measured yet)."""
    if cost is None:
        return []
    alone = [i for i, (t, ms) in enumerate(prompts) if on_time(cost, chunk, 0.0, t, ms)]
    taken: list[int] = []
    tokens, tightest = 0, float("inf")
    for i in sorted(alone, key=lambda i: prompts[i][1]):
        t, ms = prompts[i]
        if not on_time(cost, chunk, 0.0, tokens + t, CUT_SHARE * min(tightest, ms)):
            break
        taken.append(i)
        tokens, tightest = tokens + t, min(tightest, ms)
    return taken


def cut_order(prompts: list[tuple[int, float]], taken: set[int], ttft_ms: float) -> list[int]:
    """The order a cut's chunks serve the prompts in: the overdue ones (OVERDUE_X targets late),
    the cut's, then the rest, each oldest first. A late prompt gives way to a cut only until it
    is overdue: the bound on how long later arrivals may pass it over."""

    def rank(i: int) -> tuple[int, float]:
        ms = prompts[i][1]
        if i not in taken and ms <= -OVERDUE_X * ttft_ms:
            return 0, ms
        return (1 if i in taken else 2), ms

    return sorted(range(len(prompts)), key=rank)


def cut_release(members_left_ms: list[float]) -> bool:
    """Whether a cut ends now (its held prompts' first tokens come out in a RELEASE step):
    every prompt it took has its first token (`members_left_ms`: the time left of those that
    have none), or the tightest of them is late already (a prompt the pool kept out: the held
    ones wait no longer for it)."""
    return not members_left_ms or min(members_left_ms) <= 0
