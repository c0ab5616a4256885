"""The timing probe's result as types: each arm (its samples and, when it had enough pairs, its
statistics) and the probe's decision. The summary lines and the JSON come from these, so an arm
without statistics (too few pairs, no confidence interval) is a shape the code must handle, not
a missing key."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvfence.tools.leakcheck.timing_stats import ArmStats


class Decision(StrEnum):
    FINDING = "finding"  # an arm that must not share did
    CLEAN = "clean"  # the control saw caching, no other arm did, with enough power
    INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class ArmResult:
    name: str
    primer: str
    sender: str
    salts: tuple[str | None, str | None] | None
    expects_sharing: bool
    hit_s: tuple[float, ...] = ()
    fresh_s: tuple[float, ...] = ()
    stats: ArmStats | None = None  # None: fewer pairs than the statistics need

    @property
    def pairs(self) -> int:
        return self.stats.pairs if self.stats else min(len(self.hit_s), len(self.fresh_s))

    @property
    def detected(self) -> bool | None:
        return self.stats.detected if self.stats else None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "primer": self.primer,
            "sender": self.sender,
            "salts": list(self.salts) if self.salts else None,
            "expects_sharing": self.expects_sharing,
            "samples_ms": {
                "hit": [round(v * 1000, 3) for v in self.hit_s],
                "fresh": [round(v * 1000, 3) for v in self.fresh_s],
            },
            "pairs": self.pairs,
            "detected": self.detected,
        }
        st = self.stats
        if st is not None:
            out.update(
                hit_median_ms=round(st.hit_median * 1000, 3),
                fresh_median_ms=round(st.fresh_median * 1000, 3),
                auc=round(st.auc, 4),
                auc_ci=[round(st.auc_ci[0], 4), round(st.auc_ci[1], 4)],
                ks_d=round(st.ks_d, 4),
                ks_p=st.ks_p,
            )
        return out

    def line(self) -> str:
        st = self.stats
        if st is None:
            return f"  {self.name:<26}{self.pairs:>6}  (too few pairs for statistics)"
        ci = f"[{st.auc_ci[0]:.2f}, {st.auc_ci[1]:.2f}]"
        return (
            f"  {self.name:<26}{st.pairs:>6}{st.hit_median * 1000:>9.1f}"
            f"{st.fresh_median * 1000:>10.1f}{st.auc:>7.2f}{ci:>14}{st.ks_p:>9.2g}"
        )


@dataclass(frozen=True)
class TimingResult:
    prefix_tokens: int
    measure: str  # what was timed
    prompts: str  # how the prompts were built and whether /tokenize checked them
    alpha: float
    auc_floor: float
    decision: Decision
    verdict: str
    arms: tuple[ArmResult, ...] = ()
    control_saw_caching: bool = False
    power: float | None = None
    plot: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "prefix_tokens": self.prefix_tokens,
            "measure": self.measure,
            "prompts": self.prompts,
            "alpha": self.alpha,
            "auc_floor": self.auc_floor,
            "control_saw_caching": self.control_saw_caching,
            "power": self.power,
            "decision": self.decision.value,
            "verdict": self.verdict,
            "arms": [a.as_dict() for a in self.arms],
            "plot": self.plot,
        }

    def lines(self) -> list[str]:
        """The summary's timing table: one row per arm, then the verdict."""
        out = [
            "",
            f"timing (prefix {self.prefix_tokens} tokens, {self.measure}; {self.prompts}):",
            f"  {'arm':<26}{'pairs':>6}{'hit ms':>9}{'fresh ms':>10}{'AUC':>7}{'95% CI':>14}"
            f"{'KS p':>9}",
        ]
        out += [a.line() for a in self.arms]
        out.append(f"  verdict: {self.verdict}")
        return out
