"""Which waiting sequence may enter next, as far as the latency targets decide it: the order the
scheduler's fair pick (engine/fairness.py) reads the queue in. A unified engine keeps arrival
order; a PD role with a TTFT target (Scheduler.share_prompts) lets the prompts that can still
meet it go first (deadlines.on_time_first), and one OVERDUE_X targets late goes before them
(later arrivals pass a late prompt over for at most that long). With no prefill budget left in
a step, only a decode's transfers may enter: they compute nothing here."""

from __future__ import annotations

import math
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from kvfence.engine.deadlines import OVERDUE_X, on_time_first
from kvfence.engine.sequence import SeqMode, SeqStatus, Sequence
from kvfence.engine.step_budget import StepCost


def ms_left(seq: Sequence, target_ttft_ms: float, now: float) -> float:
    """ms left before seq's first token misses the TTFT target (negative: already late)."""
    return (seq.arrived - now) * 1000.0 + target_ttft_ms


def by_transfer(seq: Sequence) -> bool:
    """A decode sequence whose prompt KV still has to arrive from prefill."""
    return seq.mode is SeqMode.DECODE_ONLY and not seq.output_ids


def entry_order(
    waiting: Seq[Sequence],
    running: Iterable[Sequence],
    budget: int,
    ttft_ms: float | None,
    cost: StepCost | None,
    chunk: int,
    now: float,
) -> tuple[list[int], int]:
    """Indices of `waiting` in the order they may enter, and how many lead it on time. budget:
    the prefill tokens the step has left (none: only transfers; a decode's own prompt took the
    whole budget and 12-14 of its RESERVEs waited behind it in 1P1D at C=32, the prefill worker
    idle meanwhile); ttft_ms: the target on a PD role (None: arrival order, all on time). A
    prompt is priced after the running prompts' tokens at the fitted cost of a prefill token
    (before a fit: on time while it has time left); transfers and preempted streams count as on
    time, computing nothing here or having had their first token."""
    if budget <= 0:
        transfers = [i for i, s in enumerate(waiting) if by_transfer(s)]
        return transfers, len(transfers)
    if ttft_ms is None:
        return list(range(len(waiting))), len(waiting)
    token_ms = 0.0 if cost is None else cost.b + cost.a / max(1, chunk)
    ahead = sum(
        s.num_uncomputed for s in running if s.status is SeqStatus.RUNNING and not s.in_decode
    )
    prompts = [
        (0, math.inf)
        if s.output_ids or by_transfer(s)
        else (len(s.token_ids), ms_left(s, ttft_ms, now))
        for s in waiting
    ]
    return on_time_first(ahead, token_ms, prompts, OVERDUE_X * ttft_ms)
