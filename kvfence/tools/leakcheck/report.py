"""leakcheck's verdict and report: the JSON document (findings, tallies, every request) and the
summary table printed at the end."""

from __future__ import annotations

import time
from typing import Any

from kvfence.tools.leakcheck.common import (
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    REPORT_VERSION,
    Settings,
)
from kvfence.tools.leakcheck.run import Run

_EXCERPT = 60


def verdict_of(totals: dict[str, int]) -> tuple[str, int]:
    if totals["leaks"]:
        return "leak", EXIT_FAILED
    if totals["wrong_statuses"]:
        return "wrong_status", EXIT_FAILED
    if not totals["served"]:
        return "could_not_run", EXIT_CANNOT_RUN  # no answer was read: nothing is proven
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
    if cannot_run is not None:
        verdict, code = "could_not_run", EXIT_CANNOT_RUN
    else:
        verdict, code = verdict_of(totals)
    findings: list[dict[str, Any]] = []
    outcomes = run.outcomes if run else []
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
    errors = [o.as_dict() for o in outcomes if o.error][:20]
    return {
        "kvfence_leakcheck": REPORT_VERSION,
        "verdict": verdict,
        "exit_code": code,
        "reason": cannot_run,
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
        },
        "duration_s": round(time.monotonic() - started, 3),
        "totals": totals,
        "probes": {p: tally.as_dict() for p, tally in (run.tallies.items() if run else [])},
        "findings": findings,
        "errors": errors,
        "notes": run.notes if run else [],
        "requests": [o.as_dict() for o in outcomes],
    }


def render_summary(report: dict[str, Any]) -> str:
    t = report["target"]
    lines = [
        f"kvfence leakcheck: {t['base_url']}  model {t['model']}  context {t['context_length']} "
        f"({t['context_length_source']})  tenants {len(t['tenants'])}",
        "",
        f"{'probe':<14}{'requests':>9}{'leaks':>7}{'wrong status':>14}{'errors':>8}"
        f"{'echoed own':>12}",
    ]
    rows = [*report["probes"].items(), ("total", report["totals"])]
    for name, tally in rows:
        if not tally:
            continue
        lines.append(
            f"{name:<14}{tally['requests']:>9}{tally['leaks']:>7}{tally['wrong_statuses']:>14}"
            f"{tally['errors']:>8}{tally['echoed_own']:>12}"
        )
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
    lines += ["", f"verdict: {verdict.upper()} (exit {report['exit_code']}){why}"]
    return "\n".join(lines)
