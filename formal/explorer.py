"""Breadth-first explicit-state exploration of a formal.model.Model: hashes every world, checks
the invariants in each, and keeps the shortest trace to the first violation of each invariant."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from formal.model import Model, World

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "W", "L")
NAMES = {
    "I1": "admission: no page or transfer for a rejected request",
    "I2": "ownership: decode reads only its own request's KV",
    "I3": "completeness: commit only what counts and checksums prove",
    "I4": "release: no free page can still be written (or read by a one-sided write)",
    "I5": "status: every request ends once, never a 200 with wrong content",
    "W": "wire: every message sent is one its receiver handles",
    "L": "liveness: with faults stopped, every request ends and every page returns",
}


@dataclass(frozen=True)
class Step:
    label: str
    kind: str  # env | timeout | fault


@dataclass
class Counterexample:
    invariant: str
    message: str
    trace: list[Step]


@dataclass
class Result:
    states: int = 0
    transitions: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = True  # False when max_states cut the search short
    found: dict[str, Counterexample] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.found

    def first(self) -> Counterexample | None:
        """The shortest counterexample of all."""
        return min(self.found.values(), key=lambda c: len(c.trace), default=None)


def explore(model: Model, max_states: int | None = None, stop_early: bool = False) -> Result:
    """Visit every world reachable from model.initial(). Violating worlds are still expanded, so
    a root cause (say I1) and its consequence (an I2 read) each get their own shortest trace.
    stop_early returns at the first violation (a twin only needs one)."""
    t0 = time.perf_counter()
    start = model.initial()
    index: dict[World, int] = {start: 0}
    parent: list[int] = [-1]
    via: list[Step | None] = [None]
    depth: list[int] = [0]
    res = Result()
    queue: deque[World] = deque([start])
    ids: deque[int] = deque([0])

    def trace_to(i: int) -> list[Step]:
        steps: list[Step] = []
        while parent[i] >= 0:
            s = via[i]
            assert s is not None
            steps.append(s)
            i = parent[i]
        return steps[::-1]

    def record(inv: str, message: str, i: int) -> None:
        if inv not in res.found:
            res.found[inv] = Counterexample(inv, message, trace_to(i))

    while queue:
        w, i = queue.popleft(), ids.popleft()
        for inv, message in model.violations(w):
            record(inv, message, i)
        if stop_early and res.found:
            break
        progress = False
        recovery = False
        for label, kind, nxt in model.successors(w):
            res.transitions += 1
            if kind == "env":
                progress = True
            elif kind == "timeout":
                recovery = True
            j = index.get(nxt)
            if j is None:
                j = len(parent)
                index[nxt] = j
                parent.append(i)
                via.append(Step(label, kind))
                depth.append(depth[i] + 1)
                res.max_depth = max(res.max_depth, depth[j])
                queue.append(nxt)
                ids.append(j)
        if not progress and not model.quiescent(w):
            # A fault-free continuation has no step left: only a timeout (or nothing) remains.
            if not recovery and not model.can_time_out(w):
                record("L", "deadlock: no step left, yet not every request ended", i)
            elif model.lost_nothing(w):
                record("L", "stuck until a timeout although no message was lost", i)
        if max_states is not None and len(parent) >= max_states:
            res.complete = False
            break
    res.states = len(parent)
    res.seconds = time.perf_counter() - t0
    return res


def render(model: Model, cx: Counterexample) -> str:
    lines = [f"{cx.invariant} violated ({NAMES[cx.invariant]}):", f"  {cx.message}", "trace:"]
    for n, s in enumerate(cx.trace, 1):
        tag = "" if s.kind == "env" else f"  [{s.kind}]"
        lines.append(f"  {n:2d}. {s.label}{tag}")
    return "\n".join(lines)
