"""Named fault points that switch a guard off or misbehave on purpose, for the tests that prove
each guard matters (the twins).

The seam: production code names a fault point in one line and holds no fault branch.
- A guard point is read where the guard is: `if faults.guards().on("tag_check"): ...`. The guard
  is real behaviour; the point only turns it off (points.GUARD_POINTS maps point to guard).
- An action point is a hook the value passes through: `pages = faults.hook("write_sealed_page",
  pages, n_hit=n)`. Unarmed, the hook returns the value untouched; armed and fired, it returns
  what effects.py's effect for that point makes of it. What a fault does to state lives there,
  so every line of production code around a hook is real behaviour.

A `Faults` object is made once per process (or per engine in a test) and handed to the code that
has fault points; nothing here is global. A point can be armed only while the process runs with
KVFENCE_FAULT_INJECTION=1, by a harness in-process or by a child's entry from KVFENCE_FAULTS;
nothing an HTTP request carries reaches `arm`.
"""

from __future__ import annotations

import random
import secrets
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar, overload

from kvfence import env
from kvfence.faults.effects import EFFECTS
from kvfence.faults.points import ACTION_POINTS, GUARD_POINTS, POINTS
from kvfence.guards import ALL_ON, Guards

__all__ = ["ACTION_POINTS", "GUARD_POINTS", "POINTS", "Faults", "FaultsDisabled", "SimulatedCrash"]

T = TypeVar("T")


class FaultsDisabled(RuntimeError):
    """Arming was attempted in a process not started with KVFENCE_FAULT_INJECTION=1."""


class SimulatedCrash(RuntimeError):
    """A kill_* point fired in a process whose entry set no crash action."""


class Faults:
    """The fault points armed in this process, with the rate and seeded draw they fire at.

    `crash` is what a kill_* point does: only a child process's entry (the CLI) passes one that
    ends the process; by default the point raises SimulatedCrash."""

    def __init__(
        self,
        rate: float = 1.0,
        seed: int | None = None,
        stall_s: float = 3.0,
        crash: Callable[[str], None] | None = None,
    ) -> None:
        self.rate = rate
        self.seed = secrets.randbits(32) if seed is None else seed
        self.stall_s = stall_s
        self._random = random.Random(self.seed)
        self._crash = crash
        self._armed: set[str] = set()
        # Times each point fired: the chaos soak's count of fault effects (operator /metrics).
        self.fired: Counter[str] = Counter()

    @classmethod
    def from_env(cls, crash: Callable[[str], None] | None = None) -> Faults:
        """A child process's faults: KVFENCE_FAULTS armed (refused unless fault injection is
        on), fired at KVFENCE_FAULT_RATE with KVFENCE_FAULT_SEED."""
        faults = cls(env.fault_rate(), env.fault_seed(), env.stall_s(), crash)
        for name in env.faults():
            faults.arm(name)
        return faults

    @property
    def armed(self) -> frozenset[str]:
        return frozenset(self._armed)

    def arm(self, point: str) -> None:
        if not env.fault_injection():
            raise FaultsDisabled(
                f"fault injection is disabled; set {env.FAULT_INJECTION}=1 in a test harness"
            )
        if point not in POINTS:
            raise ValueError(f"unknown fault point {point!r}")
        self._armed.add(point)

    def disarm(self, point: str) -> None:
        self._armed.discard(point)

    @contextmanager
    def injected(self, *points: str) -> Iterator[Faults]:
        for point in points:
            self.arm(point)
        try:
            yield self
        finally:
            for point in points:
                self.disarm(point)

    @overload
    def hook(self, point: str) -> None: ...

    @overload
    def hook(self, point: str, value: T, **context: Any) -> T: ...

    def hook(self, point: str, value: Any = None, **context: Any) -> Any:
        """An action point's one line in production code: value unchanged unless point is armed
        and fires now (one draw at the rate), then what effects.EFFECTS[point] makes of it."""
        if point not in self._armed or not self.active(point):
            return value
        return EFFECTS[point](value, self, **context)

    def active(self, point: str) -> bool:
        """Whether a point fires now (each check is one draw at the rate): for hooks, guards()
        and tests; production code uses hook() or guards()."""
        if point not in self._armed:
            return False
        fires = self.rate >= 1.0 or self._random.random() < self.rate
        if fires:
            self.fired[point] += 1
        return fires

    def guards(self) -> Guards:
        """The guards that are on for this check: every one, less those an armed point turns
        off (each a draw at the rate). The one place fault points become Guards."""
        if not self._armed:
            return ALL_ON
        off = {guard for point, guard in GUARD_POINTS.items() if self.active(point)}
        return Guards(frozenset(off)) if off else ALL_ON

    def crash(self, point: str) -> None:
        """A kill_* point fired: the process dies (as its entry arranged) or this raises."""
        if self._crash is not None:
            self._crash(point)
        raise SimulatedCrash(f"fault point {point} fired")
