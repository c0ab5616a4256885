"""The latency targets a step is sized for (`--target-tpot-ms`, `--target-ttft-ms`): how long the
next step may take before a decoding stream falls behind its TPOT target, and how many prompt
tokens it must compute so every waiting prompt can still get its first token within the TTFT
target. Arithmetic only: the scheduler hands in the times, the step-time budget
(kvfence/engine/step_budget.py) turns them into a step's prefill tokens.

TPOT side (goodput counts a request whose mean time per output token is within the target): a
stream that got its first token at f and has n tokens out is on pace while its next token comes
by f + n * target, so the step may take the smallest such slack among the rows, never more than
one target (a stream ahead of pace does not bank a long stall: the inter-token latency tail
stays within a target) and never less than the decode-only step (a row behind its pace is
helped by a step without prefill, not by none). A stream that cannot get back on pace even if
every token it has left came at the decode-only step of the rows now decoding has lost its target
(`tpot_lost`): it bounds no step, and once every decoding stream has, the steps take the auto
target as without one (step_budget.step_target_ms).

TTFT side: prompts are computed in the order they are served (FIFO), so prompt j is done once
the C_j tokens up to and including it are. With d the decode-only step and b the cost of a
prefill token, a step of t prompt tokens takes d + b * t, and within its L_j ms left
L_j / (d + b * t) steps compute t tokens each: on time when t >= C_j * d / (L_j - C_j * b). The
floor is the largest of these over the prompts that can still be on time. One that cannot (even
a step of nothing but its tokens would be late) asks for nothing: goodput has lost it, and
hurrying it with whole chunks (the first version did) stalled every stream and made the prompts
behind it late too (benchmarks/step_budget_sim.py: C=8 ITL p99 603 ms, TTFT p50 1.2 s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# A prompt this many TTFT targets late is served ahead of prompts that can still be on time (a
# PD role's on_time_first) and of a cut (waves.cut_order): the bound on how long later arrivals
# may pass it over.
OVERDUE_X = 1.0


def tpot_slack_ms(target_ms: float, rows: Iterable[tuple[float, int]], now: float) -> float:
    """The smallest slack (ms) before a decoding stream's next token is late for its TPOT
    target, capped at one target. rows: (first token time in s, tokens out so far)."""
    slack = target_ms
    for first_at, n_out in rows:
        slack = min(slack, (first_at - now) * 1000.0 + target_ms * n_out)
    return slack


def tpot_lost(
    target_ms: float, first_at: float, n_out: int, left: int, fastest_ms: float, now: float
) -> bool:
    """Whether a stream (first token at `first_at` s, `n_out` out, `left` more to come at most)
    misses its TPOT target even if each of those came `fastest_ms` apart from now on: its last
    token is due by first_at + target x (n_out + left - 1)."""
    due_ms = (first_at - now) * 1000.0 + target_ms * (n_out + left - 1)
    return left * fastest_ms > due_ms


def tpot_step_ms(target_ms: float, slack_ms: float, decode_ms: float) -> float:
    """The step time the TPOT target leaves: the tightest slack, at least the decode-only step."""
    return max(decode_ms, min(target_ms, slack_ms))


def ttft_floor(
    decode_ms: float, token_ms: float, prompts: Iterable[tuple[int, float]], cap: int
) -> int:
    """Prompt tokens a step must compute so each waiting prompt meets its TTFT target, a step
    costing decode_ms plus token_ms per prompt token. prompts: in the order they are served,
    (tokens to compute up to and including it, ms left to its target). At most `cap`: a prompt
    that cannot be on time any more asks for nothing: its first token is late whatever the
    step does (goodput has lost it), and hurrying it would make the prompts behind it late
    too; it still goes first, so its tokens count toward theirs."""
    floor = 0
    for cum, left_ms in prompts:
        room = left_ms - cum * token_ms
        if room <= 0:
            continue
        floor = max(floor, math.ceil(cum * decode_ms / room))
        if floor >= cap:
            return cap
    return floor


def on_time_first(
    ahead: int,
    token_ms: float,
    prompts: Iterable[tuple[int, float]],
    overdue_ms: float = math.inf,
) -> tuple[list[int], int]:
    """The order waiting prompts are served in (indices into `prompts`, each (tokens to compute,
    ms left to its TTFT target), in arrival order): those that can still get their first token
    on time, computed after the `ahead` tokens already running and the on-time ones before
    them at token_ms a token, in arrival order; then the ones that cannot. A late prompt is
    lost to goodput wherever it is served, and served first it makes every prompt behind it
    late too: 1P1D at C=32 on 2 loaded cores, the prefill worker served a burst's 30 prompts
    in arrival order, first tokens 2.5-27 s after arrival, so a prompt arriving meanwhile
    waited behind all of them (served first, it waits for a chunk or two). A prompt overdue_ms
    past its target (OVERDUE_X targets) goes ahead of them all, oldest first, and counts as
    leading: later arrivals pass a late prompt over for at most that long, so under sustained
    load it is served late rather than never (in PD it would wait for the disaggregation
    timeout's 504). Also returns how many lead the order (the overdue and the on time)."""
    work = list(prompts)
    overdue = [i for i, (_, left_ms) in enumerate(work) if left_ms <= -overdue_ms]
    on: list[int] = []
    late: list[int] = []
    cum = ahead + sum(work[i][0] for i in overdue)
    for i, (tokens, left_ms) in enumerate(work):
        if left_ms <= -overdue_ms:
            continue
        if (cum + tokens) * token_ms < left_ms:
            on.append(i)
            cum += tokens
        else:
            late.append(i)
    return overdue + on + late, len(overdue) + len(on)
