"""What a leakcheck run found, as types: a leak (another request's canary in an answer), a status
wrong on its face, and a prefix cache shared across tenants (timing). Each says its summary line
and its JSON itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvfence.tools.canary import Leak
from kvfence.tools.leakcheck.judge import Outcome

_EXCERPT = 60


def _excerpt(text: str, fragment: str) -> str:
    i = text.upper().find(fragment)
    if i < 0:
        return text[: 2 * _EXCERPT]
    return text[max(0, i - _EXCERPT) : i + len(fragment) + _EXCERPT]


def _request(kind: str, o: Outcome) -> dict[str, Any]:
    """What every finding about one request says of it."""
    return {
        "kind": kind,
        "probe": o.probe,
        "case": o.case,
        "request_id": o.request_id,
        "server_id": o.reply.server_id,
        "status": o.reply.status,
        "prompt_tokens": o.prompt_tokens,
    }


@dataclass(frozen=True)
class LeakFinding:
    outcome: Outcome
    leak: Leak

    kind = "leak"

    def as_dict(self) -> dict[str, Any]:
        r = self.outcome.reply
        return {
            **_request(self.kind, self.outcome),
            **{k: v for k, v in self.leak.as_dict().items() if k != "kind"},
            "leak_kind": self.leak.kind,
            "cross_tenant": self.leak.cross_tenant,
            "output_excerpt": _excerpt(r.text + (r.error or ""), self.leak.fragment),
        }

    def line(self) -> str:
        o, leak = self.outcome, self.leak
        return (
            f"  LEAK [{o.probe}: {o.case}] request {o.request_id} (tenant {leak.reader_tenant}, "
            f"HTTP {o.reply.status}) holds {leak.fragment!r} of request {leak.owner_request_id} "
            f"(tenant {leak.owner_tenant}, {leak.kind})"
        )


@dataclass(frozen=True)
class StatusFinding:
    outcome: Outcome
    detail: str

    kind = "wrong_status"

    def as_dict(self) -> dict[str, Any]:
        return {
            **_request(self.kind, self.outcome),
            "max_tokens": self.outcome.max_tokens,
            "detail": self.detail,
        }

    def line(self) -> str:
        o = self.outcome
        return f"  WRONG STATUS [{o.probe}: {o.case}] request {o.request_id}: {self.detail}"


@dataclass(frozen=True)
class TimingFinding:
    detail: str

    kind = "timing"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "probe": "timing", "detail": self.detail}

    def line(self) -> str:
        return f"  TIMING: {self.detail}"


Finding = LeakFinding | StatusFinding | TimingFinding


def findings_of(outcomes: list[Outcome]) -> list[Finding]:
    out: list[Finding] = []
    for o in outcomes:
        out += [LeakFinding(o, leak) for leak in o.leaks]
        if o.wrong_status:
            out.append(StatusFinding(o, o.wrong_status))
    return out
