"""Which probes run, in what order, and each one's share of `--requests`: every probe gets at
least what one pass over its cases needs, or is reported as skipped with the reason; what a
probe leaves unspent goes to the next."""

from __future__ import annotations

import time

# Each probe by its own module, not through the package (whose __init__ imports the CLI).
import kvfence.tools.leakcheck.admission as admission
import kvfence.tools.leakcheck.cancellation as cancellation
import kvfence.tools.leakcheck.crosstalk as crosstalk
import kvfence.tools.leakcheck.discovery as discovery
import kvfence.tools.leakcheck.stale_bait as stale_bait
import kvfence.tools.leakcheck.timing as timing
from kvfence.tools.leakcheck.cases import State
from kvfence.tools.leakcheck.common import CANARY_PROBES, Settings
from kvfence.tools.leakcheck.run import Run

# Requests one pass over a probe's cases needs (admission without a tokenizer measures by
# sending; with one it needs 7).
MIN_SHARE = {"admission": 24, "crosstalk": 4, "stale_bait": 14, "cancellation": 6}
# How what is left over is shared (admission needs no more than one pass).
WEIGHT = {"admission": 0, "crosstalk": 5, "stale_bait": 3, "cancellation": 2}


def selected(settings: Settings) -> list[str]:
    """The probes to run, in run order."""
    wanted = settings.probes if settings.probes is not None else CANARY_PROBES
    return [p for p in CANARY_PROBES if p in wanted and p not in settings.skip_probes]


def shares(probes: list[str], budget: int, tokenizer: bool) -> dict[str, int]:
    need = dict(MIN_SHARE)
    if tokenizer:
        need["admission"] = 8
    out: dict[str, int] = {}
    left = budget
    for p in probes:  # each its minimum, in order, while the budget lasts
        out[p] = min(need[p], left)
        left -= out[p]
    weights = {p: WEIGHT[p] for p in probes if WEIGHT[p]}
    total = sum(weights.values())
    for p, w in weights.items():
        out[p] += left * w // total if total else 0
    if weights:  # rounding leftovers to the first weighted probe
        first = next(iter(weights))
        out[first] += budget - sum(out.values())
    return out


async def run_all(run: Run) -> None:
    """Setup, then every selected probe in turn, each within its share of the budget; the
    timing probe last, with half the budget when canary probes run too (all of it alone)."""
    s = run.s
    probes = selected(s)
    explicit_timing = s.probes is not None and "timing" in s.probes
    want_timing = (s.probes is None or explicit_timing) and "timing" not in s.skip_probes
    run.cases.excluded = {p for p in CANARY_PROBES if p not in probes}
    if not want_timing:
        run.cases.excluded.add("timing")
    await discovery.setup(run)
    t = run.target
    assert t is not None
    timing_on = want_timing and (explicit_timing or len(t.tenants) >= 2)
    if want_timing and not timing_on:
        run.cases.set_probe(
            "timing", State.NOT_APPLICABLE, "one tenant: needs two API keys of different tenants"
        )
    if not timing_on:
        run.tallies.pop("timing", None)
    timing_share = (run.left // 2 if probes else run.left) if timing_on else 0
    canary_end = run.sent + run.left - timing_share
    tokenizer = t.tokenizer == "server"
    for i, p in enumerate(probes):
        # Shares are worked out again before each probe, so what one leaves unspent is shared
        # among all that follow (never taken by the next alone).
        run.cap = None
        share = shares(probes[i:], max(0, min(run.left, canary_end - run.sent)), tokenizer)[p]
        need = 8 if p == "admission" and tokenizer else MIN_SHARE[p]
        if 0 < share < need:
            run.notes.append(f"{p}: --requests leaves it {share} requests; one pass needs {need}")
        if time.monotonic() > run.deadline:
            run.cases.set_probe(p, State.SKIPPED, "--duration ran out before it started")
            continue
        if share == 0:
            run.cases.set_probe(p, State.SKIPPED, "--requests ran out before it started")
            continue
        run.cap = run.sent + share
        await _PROBES[p](run)
    run.cap = None
    if timing_on:
        if time.monotonic() > run.deadline:
            run.cases.set_probe("timing", State.SKIPPED, "--duration ran out before it started")
        else:
            await timing.probe(run, run.left)
    if run.stopped_early:
        run.notes.append(f"stopped early: --{run.stopped_early} reached")


async def _admission(run: Run) -> None:
    await admission.probe(run)


async def _crosstalk(run: Run) -> None:
    await crosstalk.probe(run, run.left)


async def _stale_bait(run: Run) -> None:
    await stale_bait.probe(run, run.left)


async def _cancellation(run: Run) -> None:
    await cancellation.probe(run, run.left)


_PROBES = {
    "admission": _admission,
    "crosstalk": _crosstalk,
    "stale_bait": _stale_bait,
    "cancellation": _cancellation,
}
