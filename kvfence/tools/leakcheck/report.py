"""leakcheck's verdict and report: the JSON document (findings, tallies, every request) and the
summary table printed at the end."""

from __future__ import annotations

import time
from typing import Any

from kvfence.tools.leakcheck.common import (
    ALL_PROBES,
    CANARY_PROBES,
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    REPORT_VERSION,
    Settings,
)
from kvfence.tools.leakcheck.judge import Outcome
from kvfence.tools.leakcheck.run import Run

_EXCERPT = 60


def verdict_of(
    totals: dict[str, int],
    incomplete: list[str] | None = None,
    *,
    allow_incomplete: bool = False,
    timing: str | None = None,
) -> tuple[str, int]:
    """(verdict, exit code). A finding wins; then "could not run" (no answer read); then
    INCOMPLETE when a check the user did not exclude could not be judged; only then clean.
    `timing` is the timing probe's own verdict when it ran ("finding", "inconclusive", ...)."""
    if totals["leaks"]:
        return "leak", EXIT_FAILED
    if totals["wrong_statuses"]:
        return "wrong_status", EXIT_FAILED
    if timing == "finding":
        return "shares_cache_across_tenants", EXIT_FAILED
    if not totals["served"]:
        return "could_not_run", EXIT_CANNOT_RUN  # no answer was read: nothing is proven
    if incomplete:
        return "incomplete", EXIT_CLEAN if allow_incomplete else EXIT_CANNOT_RUN
    return "clean", EXIT_CLEAN


def _excerpt(text: str, fragment: str) -> str:
    i = text.upper().find(fragment)
    if i < 0:
        return text[: 2 * _EXCERPT]
    return text[max(0, i - _EXCERPT) : i + len(fragment) + _EXCERPT]


def build_report(
    settings: Settings, run: Run | None, started: float, cannot_run: str | None
) -> dict[str, Any]:
    t = run.target if run else None
    totals = run.totals() if run else {}
    # The timing probe decides the exit code only when it runs alone; otherwise an inconclusive
    # timing result is reported, not counted (see README).
    timing_alone = settings.probes == ("timing",)
    judged = ["setup", *CANARY_PROBES, *(["timing"] if timing_alone else [])]
    incomplete = run.cases.incomplete(judged) if run else []
    timing = run.timing if run else None
    if cannot_run is not None:
        verdict, code = "could_not_run", EXIT_CANNOT_RUN
    else:
        verdict, code = verdict_of(
            totals,
            incomplete,
            allow_incomplete=settings.allow_incomplete,
            timing=timing["decision"] if timing else None,
        )
    outcomes = run.outcomes if run else []
    findings = _findings(outcomes)
    if timing and timing["decision"] == "finding":
        findings.append({"kind": "timing", "probe": "timing", "detail": timing["verdict"]})
    states = _states(run)
    probes = {p: tally.as_dict() for p, tally in (run.tallies.items() if run else [])}
    for p, tally in probes.items():
        tally.update(states.get(p, {"state": "skipped", "reason": "not run"}))
    errors = [o.as_dict() for o in outcomes if o.error][:20]
    return {
        "kvfence_leakcheck": REPORT_VERSION,
        "verdict": verdict,
        "exit_code": code,
        "reason": cannot_run,
        "incomplete": incomplete,
        "target": {
            "base_url": settings.base_url,
            "model": t.model if t else settings.model,
            "context_length": t.context_length if t else settings.context_length,
            "context_length_source": t.context_source if t else None,
            "tenants": [x.name for x in t.tenants] if t else [x.name for x in settings.tenants],
            "endpoints": (["completions"] if t.completions else []) + (["chat"] if t.chat else [])
            if t
            else [],
            "token_counts": t.tokenizer if t else None,
        },
        "settings": {
            "requests": settings.requests,
            "concurrency": settings.concurrency,
            "duration_s": settings.duration,
            "seed": settings.seed,
            "probes": list(settings.probes) if settings.probes is not None else "default",
            "skip_probes": list(settings.skip_probes),
            "allow_incomplete": settings.allow_incomplete,
        },
        "duration_s": round(time.monotonic() - started, 3),
        "totals": totals,
        "probes": probes,
        "probe_states": states,
        "cases": run.cases.as_list() if run else [],
        "timing": timing,
        "findings": findings,
        "errors": errors,
        "notes": run.notes if run else [],
        "requests": [o.as_dict() for o in outcomes],
    }


def _states(run: Run | None) -> dict[str, dict[str, Any]]:
    """Every probe's state (ran, inconclusive, skipped, excluded, not applicable) and why."""
    if run is None:
        return {}
    out = {}
    for p in ("setup", *ALL_PROBES):
        state, reason = run.cases.probe_state(p)
        out[p] = {"state": state.value, "reason": reason}
    return out


def _findings(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    findings: list[dict[str, Any]] = []
    for o in outcomes:
        for leak in o.leaks:
            findings.append(
                {
                    "kind": "leak",
                    "probe": o.probe,
                    "case": o.case,
                    "request_id": o.request_id,
                    "server_id": o.reply.server_id,
                    "status": o.reply.status,
                    "prompt_tokens": o.prompt_tokens,
                    **{k: v for k, v in leak.as_dict().items() if k != "kind"},
                    "leak_kind": leak.kind,
                    "cross_tenant": leak.cross_tenant,
                    "output_excerpt": _excerpt(o.reply.text + (o.reply.error or ""), leak.fragment),
                }
            )
        if o.wrong_status:
            findings.append(
                {
                    "kind": "wrong_status",
                    "probe": o.probe,
                    "case": o.case,
                    "request_id": o.request_id,
                    "server_id": o.reply.server_id,
                    "status": o.reply.status,
                    "prompt_tokens": o.prompt_tokens,
                    "max_tokens": o.max_tokens,
                    "detail": o.wrong_status,
                }
            )
    return findings


def render_summary(report: dict[str, Any]) -> str:
    t = report["target"]
    lines = [
        f"kvfence leakcheck: {t['base_url']}  model {t['model']}  context {t['context_length']} "
        f"({t['context_length_source']})  tenants {len(t['tenants'])}",
        "",
        f"{'probe':<14}{'state':<15}{'requests':>9}{'leaks':>7}{'wrong status':>14}"
        f"{'errors':>8}{'echoed own':>12}",
    ]
    rows = [*report["probes"].items(), ("total", report["totals"])]
    for name, tally in rows:
        if not tally:
            continue
        lines.append(
            f"{name:<14}{tally.get('state', ''):<15}{tally['requests']:>9}{tally['leaks']:>7}"
            f"{tally['wrong_statuses']:>14}{tally['errors']:>8}{tally['echoed_own']:>12}"
        )
    for name, st in report.get("probe_states", {}).items():
        if name not in report["probes"]:
            lines.append(f"{name:<14}{st['state']:<15}({st['reason']})")
    lines += _timing_lines(report.get("timing"))
    unjudged = [c for c in report.get("cases", []) if c["state"] in ("inconclusive", "skipped")]
    if unjudged:
        lines += ["", "not judged (the run cannot be called clean while these stand):"]
    for c in unjudged[:12]:
        lines.append(f"  {c['state'].upper()} [{c['probe']}: {c['case']}] {c['reason']}")
    if len(unjudged) > 12:
        lines.append(f"  ... {len(unjudged) - 12} more in the report")
    shown = report["findings"][:10]
    if shown:
        lines += ["", "findings:"]
    for f in shown:
        if f["kind"] == "leak":
            lines.append(
                f"  LEAK [{f['probe']}: {f['case']}] request {f['request_id']} "
                f"(tenant {f['reader_tenant']}, HTTP {f['status']}) holds {f['fragment']!r} of "
                f"request {f['owner_request_id']} (tenant {f['owner_tenant']}, {f['leak_kind']})"
            )
        elif f["kind"] == "timing":
            lines.append(f"  TIMING: {f['detail']}")
        else:
            lines.append(
                f"  WRONG STATUS [{f['probe']}: {f['case']}] request {f['request_id']}: "
                f"{f['detail']}"
            )
    if len(report["findings"]) > len(shown):
        lines.append(f"  ... {len(report['findings']) - len(shown)} more in the report")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    totals = report["totals"]
    if totals.get("served") and totals.get("echoed_own", 0) < 0.5 * totals["served"]:
        lines.append(
            "note: fewer than half the answers repeated their own canaries; this model copies "
            "its context rarely, so a leak could stay unseen"
        )
    verdict = report["verdict"]
    why = f": {report['reason']}" if report["reason"] else ""
    if verdict == "incomplete":
        why = ": " + "; ".join(report["incomplete"])
    lines += ["", f"verdict: {verdict.upper()} (exit {report['exit_code']}){why}"]
    return "\n".join(lines)


def _timing_lines(timing: dict[str, Any] | None) -> list[str]:
    """The timing probe's arms: samples, medians, AUC with its CI, KS p-value, and its verdict."""
    if not timing:
        return []
    lines = [
        "",
        f"timing (prefix {timing['prefix_tokens']} tokens, {timing['measure']}):",
        f"  {'arm':<26}{'pairs':>6}{'hit ms':>9}{'fresh ms':>10}{'AUC':>7}{'95% CI':>14}"
        f"{'KS p':>9}",
    ]
    for arm in timing["arms"]:
        ci = f"[{arm['auc_ci'][0]:.2f}, {arm['auc_ci'][1]:.2f}]"
        lines.append(
            f"  {arm['name']:<26}{arm['pairs']:>6}{arm['hit_median_ms']:>9.1f}"
            f"{arm['fresh_median_ms']:>10.1f}{arm['auc']:>7.2f}{ci:>14}{arm['ks_p']:>9.2g}"
        )
    lines.append(f"  verdict: {timing['verdict']}")
    return lines
