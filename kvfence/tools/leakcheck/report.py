"""leakcheck's verdict and report as types: `Report` (findings, tallies, states, every request),
built from what a run left however partial, its JSON (`as_dict`) and the summary printed at the
end (`render_summary`). Nothing here looks a key up in a dict, so no shape of a run can crash
the verdict."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvfence.tools.leakcheck.cases import Case, State
from kvfence.tools.leakcheck.common import (
    ALL_PROBES,
    CANARY_PROBES,
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    REPORT_VERSION,
    Settings,
)
from kvfence.tools.leakcheck.findings import Finding, TimingFinding, findings_of
from kvfence.tools.leakcheck.judge import Outcome
from kvfence.tools.leakcheck.run import Run, Target
from kvfence.tools.leakcheck.tally import ProbeTally
from kvfence.tools.leakcheck.timing_result import Decision, TimingResult

_SHOWN_CASES = 12
_SHOWN_FINDINGS = 10


class Verdict(StrEnum):
    CLEAN = "clean"
    LEAK = "leak"
    WRONG_STATUS = "wrong_status"
    SHARES_CACHE = "shares_cache_across_tenants"
    COULD_NOT_RUN = "could_not_run"
    INCOMPLETE = "incomplete"


def verdict_of(
    totals: ProbeTally,
    incomplete: Sequence[str] = (),
    *,
    allow_incomplete: bool = False,
    timing: Decision | None = None,
    cannot_run: str | None = None,
    internal_error: str | None = None,
) -> tuple[Verdict, int]:
    """(verdict, exit code). Exit 1 only for what was seen: a leak, a status wrong on its face,
    a cache shared across tenants. Then "could not run" (no answer read, or setup failed), an
    internal error (INCOMPLETE, exit 2 even with --allow-incomplete: the tool failed, not a
    check), INCOMPLETE when a check the user did not exclude could not be judged; only then
    clean."""
    if totals.leaks:
        return Verdict.LEAK, EXIT_FAILED
    if totals.wrong_statuses:
        return Verdict.WRONG_STATUS, EXIT_FAILED
    if timing is Decision.FINDING:
        return Verdict.SHARES_CACHE, EXIT_FAILED
    if cannot_run is not None:
        return Verdict.COULD_NOT_RUN, EXIT_CANNOT_RUN
    if internal_error is not None:
        return Verdict.INCOMPLETE, EXIT_CANNOT_RUN
    if not totals.served:
        return Verdict.COULD_NOT_RUN, EXIT_CANNOT_RUN  # no answer was read: nothing is proven
    if incomplete:
        return Verdict.INCOMPLETE, EXIT_CLEAN if allow_incomplete else EXIT_CANNOT_RUN
    return Verdict.CLEAN, EXIT_CLEAN


@dataclass(frozen=True)
class ProbeRow:
    name: str
    state: State
    reason: str | None
    tally: ProbeTally | None  # None: the probe sent nothing it counts (not run, excluded)


@dataclass(frozen=True)
class Report:
    settings: Settings
    verdict: Verdict
    exit_code: int
    reason: str | None  # why it could not run, or the internal error
    duration_s: float
    incomplete: tuple[str, ...] = ()
    target: Target | None = None
    totals: ProbeTally = field(default_factory=ProbeTally)
    rows: tuple[ProbeRow, ...] = ()
    cases: tuple[Case, ...] = ()
    timing: TimingResult | None = None
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()
    outcomes: tuple[Outcome, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        s, t = self.settings, self.target
        endpoints = []
        if t is not None:
            endpoints = (["completions"] if t.completions else []) + (["chat"] if t.chat else [])
        return {
            "kvfence_leakcheck": REPORT_VERSION,
            "verdict": self.verdict.value,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "incomplete": list(self.incomplete),
            "target": {
                "base_url": s.base_url,
                "model": t.model if t else s.model,
                "context_length": t.context_length if t else s.context_length,
                "context_length_source": t.context_source if t else None,
                "tenants": [x.name for x in (t.tenants if t else s.tenants)],
                "endpoints": endpoints,
                "token_counts": t.tokenizer if t else None,
            },
            "settings": {
                "requests": s.requests,
                "concurrency": s.concurrency,
                "duration_s": s.duration,
                "seed": s.seed,
                "probes": list(s.probes) if s.probes is not None else "default",
                "skip_probes": list(s.skip_probes),
                "allow_incomplete": s.allow_incomplete,
            },
            "duration_s": self.duration_s,
            "totals": self.totals.as_dict(),
            "probes": {
                r.name: {**r.tally.as_dict(), "state": r.state.value, "reason": r.reason}
                for r in self.rows
                if r.tally is not None
            },
            "probe_states": {
                r.name: {"state": r.state.value, "reason": r.reason} for r in self.rows
            },
            "cases": [c.as_dict() for c in self.cases],
            "timing": self.timing.as_dict() if self.timing else None,
            "findings": [f.as_dict() for f in self.findings],
            "errors": [o.as_dict() for o in self.outcomes if o.error][:20],
            "notes": list(self.notes),
            "requests": [o.as_dict() for o in self.outcomes],
        }


def failed_report(settings: Settings, started: float, reason: str) -> Report:
    """The report when nothing of the run can be used (the tool itself failed): exit 2."""
    return Report(
        settings,
        Verdict.INCOMPLETE,
        EXIT_CANNOT_RUN,
        reason,
        round(time.monotonic() - started, 3),
        incomplete=(reason,),
    )


def build_report(
    settings: Settings,
    run: Run | None,
    started: float,
    cannot_run: str | None,
    internal_error: str | None = None,
) -> Report:
    duration = round(time.monotonic() - started, 3)
    said = (cannot_run, f"internal error: {internal_error}" if internal_error else None)
    reason = "; ".join(x for x in said if x) or None
    if run is None:
        verdict, code = verdict_of(
            ProbeTally(), cannot_run=cannot_run, internal_error=internal_error
        )
        return Report(settings, verdict, code, reason, duration)
    totals = run.totals()
    # The timing probe decides the exit code only when it runs alone; otherwise an inconclusive
    # timing result is reported, not counted (see README).
    timing_alone = settings.probes == ("timing",)
    judged = ["setup", *CANARY_PROBES, *(["timing"] if timing_alone else [])]
    incomplete = run.cases.incomplete(judged)
    if internal_error is not None:
        incomplete.append(f"internal error: {internal_error}")
    timing = run.timing
    verdict, code = verdict_of(
        totals,
        incomplete,
        allow_incomplete=settings.allow_incomplete,
        timing=timing.decision if timing else None,
        cannot_run=cannot_run,
        internal_error=internal_error,
    )
    findings: list[Finding] = list(findings_of(run.outcomes))
    if timing is not None and timing.decision is Decision.FINDING:
        findings.append(TimingFinding(timing.verdict))
    rows = []
    for p in ("setup", *ALL_PROBES):
        state, why = run.cases.probe_state(p)
        rows.append(ProbeRow(p, state, why, run.tallies.get(p)))
    return Report(
        settings,
        verdict,
        code,
        reason,
        duration,
        incomplete=tuple(incomplete),
        target=run.target,
        totals=totals,
        rows=tuple(rows),
        cases=tuple(run.cases.items.values()),
        timing=timing,
        findings=tuple(findings),
        notes=tuple(run.notes),
        outcomes=tuple(run.outcomes),
    )


def render_summary(report: Report) -> str:
    s, t = report.settings, report.target
    model = t.model if t else s.model
    ctx = t.context_length if t else s.context_length
    source = t.context_source if t else None
    tenants = len(t.tenants) if t else len(s.tenants)
    lines = [
        f"kvfence leakcheck: {s.base_url}  model {model}  context {ctx} ({source})  "
        f"tenants {tenants}",
        "",
        f"{'probe':<14}{'state':<15}{'requests':>9}{'leaks':>7}{'wrong status':>14}"
        f"{'errors':>8}{'echoed own':>12}",
    ]
    for r in report.rows:
        if r.tally is not None:
            lines.append(_tally_line(r.name, r.state.value, r.tally))
    if report.rows:
        lines.append(_tally_line("total", "", report.totals))
    for r in report.rows:
        if r.tally is None:
            lines.append(f"{r.name:<14}{r.state.value:<15}({r.reason})")
    if report.timing is not None:
        lines += report.timing.lines()
    unjudged = [(c, *c.state()) for c in report.cases]
    unjudged = [
        (c, st, why) for c, st, why in unjudged if st in (State.INCONCLUSIVE, State.SKIPPED)
    ]
    if unjudged:
        lines += ["", "not judged (the run cannot be called clean while these stand):"]
    for c, st, why in unjudged[:_SHOWN_CASES]:
        lines.append(f"  {st.value.upper()} [{c.probe}: {c.name}] {why}")
    if len(unjudged) > _SHOWN_CASES:
        lines.append(f"  ... {len(unjudged) - _SHOWN_CASES} more in the report")
    shown = report.findings[:_SHOWN_FINDINGS]
    if shown:
        lines += ["", "findings:"]
    lines += [f.line() for f in shown]
    if len(report.findings) > len(shown):
        lines.append(f"  ... {len(report.findings) - len(shown)} more in the report")
    lines += [f"note: {note}" for note in report.notes]
    totals = report.totals
    if totals.served and totals.echoed_own < 0.5 * totals.served:
        lines.append(
            "note: fewer than half the answers repeated their own canaries; this model copies "
            "its context rarely, so a leak could stay unseen"
        )
    why = f": {report.reason}" if report.reason else ""
    if report.verdict is Verdict.INCOMPLETE and report.incomplete:
        why = ": " + "; ".join(report.incomplete)
    lines += ["", f"verdict: {report.verdict.value.upper()} (exit {report.exit_code}){why}"]
    return "\n".join(lines)


def _tally_line(name: str, state: str, t: ProbeTally) -> str:
    return (
        f"{name:<14}{state:<15}{t.requests:>9}{t.leaks:>7}{t.wrong_statuses:>14}"
        f"{t.errors:>8}{t.echoed_own:>12}"
    )
