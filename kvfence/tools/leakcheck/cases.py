"""What was checked: every probe and case ends `ran`, `inconclusive` (sent, but no answer could be
judged), `skipped` (not sent, with the reason), `excluded` (the user said so) or
`not_applicable` (the server lacks what the case needs, e.g. chat). A run with a case that the
user did not exclude and that did not run is INCOMPLETE, never clean."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class State(StrEnum):
    RAN = "ran"
    INCONCLUSIVE = "inconclusive"
    SKIPPED = "skipped"
    EXCLUDED = "excluded"
    NOT_APPLICABLE = "not_applicable"


# States that leave nothing unchecked that the user asked for.
COMPLETE = {State.RAN, State.EXCLUDED, State.NOT_APPLICABLE}


class Kind(StrEnum):
    """What a case's requests are for, and so what "judged" means for each of them."""

    STATUS = "status"  # the status code at a length edge: every send must be judged
    READ = "read"  # answers read for canaries: one judged answer is enough
    DISCOVER = "discover"  # learning what the server offers: any answer tells


@dataclass
class Case:
    probe: str
    name: str
    kind: Kind
    requests: int = 0
    judged: int = 0
    first_unjudged: str | None = None  # why the first unjudged send was not judged
    forced: State | None = None  # set explicitly (skipped, inconclusive, not applicable)
    reason: str | None = None

    def state(self) -> tuple[State, str | None]:
        if self.forced is not None:
            return self.forced, self.reason
        if self.requests == 0:
            return State.SKIPPED, self.reason or "not sent: its share of --requests or time ran out"
        if self.kind is Kind.STATUS and self.judged < self.requests:
            return State.INCONCLUSIVE, self.first_unjudged
        if self.judged == 0:
            return State.INCONCLUSIVE, self.first_unjudged
        return State.RAN, None

    def as_dict(self) -> dict[str, Any]:
        state, reason = self.state()
        return {
            "probe": self.probe,
            "case": self.name,
            "kind": self.kind.value,
            "state": state.value,
            "reason": reason,
            "requests": self.requests,
            "judged": self.judged,
        }


@dataclass
class Cases:
    """Every case of the run, in the order first planned or sent."""

    items: dict[tuple[str, str], Case] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)  # probes the user left out
    probe_reasons: dict[str, tuple[State, str]] = field(default_factory=dict)

    def get(self, probe: str, name: str, kind: Kind) -> Case:
        key = (probe, name)
        if key not in self.items:
            self.items[key] = Case(probe, name, kind)
        return self.items[key]

    def plan(self, probe: str, name: str, kind: Kind) -> None:
        """Declare a case, so that it shows as skipped if it is never sent."""
        self.get(probe, name, kind)

    def record(self, probe: str, name: str, kind: Kind, judged: bool, why: str | None) -> None:
        case = self.get(probe, name, kind)
        case.requests += 1
        case.judged += judged
        if not judged and case.first_unjudged is None:
            case.first_unjudged = why

    def force(self, probe: str, name: str, kind: Kind, state: State, reason: str) -> None:
        case = self.get(probe, name, kind)
        case.forced, case.reason = state, reason

    def set_probe(self, probe: str, state: State, reason: str) -> None:
        """A whole probe's state when it has no cases to show for it (excluded, not run)."""
        self.probe_reasons[probe] = (state, reason)

    def probe_state(self, probe: str) -> tuple[State, str | None]:
        if probe in self.excluded:
            return State.EXCLUDED, "left out by the user"
        if probe in self.probe_reasons:
            return self.probe_reasons[probe]
        mine = [c for c in self.items.values() if c.probe == probe]
        if not mine:
            return State.SKIPPED, "not run"
        states = [(c, *c.state()) for c in mine]
        bad = [(c, s, r) for c, s, r in states if s not in COMPLETE]
        if not bad:
            return State.RAN, None
        if all(c.requests == 0 for c in mine):
            return State.SKIPPED, bad[0][2]
        c, s, r = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        return State.INCONCLUSIVE, f"case {c.name!r} {s.value}: {r}{more}"

    def incomplete(self, probes: list[str]) -> list[str]:
        """Why the run is incomplete: one line per probe that did not fully run."""
        out = []
        for p in probes:
            state, reason = self.probe_state(p)
            if state not in COMPLETE:
                out.append(f"{p} {state.value}: {reason}")
        return out

    def as_list(self) -> list[dict[str, Any]]:
        return [c.as_dict() for c in self.items.values()]
