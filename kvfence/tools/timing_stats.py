"""Two-sample statistics for timing side channels: ROC AUC (how well one sample's values tell
it from the other's) and the two-sample Kolmogorov-Smirnov test. Pure Python, no SciPy."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence


def auc(pos: Sequence[float], neg: Sequence[float]) -> float:
    """P(a value of pos > a value of neg) + 0.5 P(tie): 0.5 means no threshold separates
    them; 1.0 (or 0.0) means one does perfectly."""
    if not pos or not neg:
        raise ValueError("auc needs two non-empty samples")
    ranked = sorted(neg)
    wins = 0.0
    for x in pos:
        lo = bisect.bisect_left(ranked, x)
        hi = bisect.bisect_right(ranked, x)
        wins += lo + 0.5 * (hi - lo)
    return wins / (len(pos) * len(neg))


def ks_2samp(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(D, p): the largest gap between the two empirical CDFs and its asymptotic p-value
    (Kolmogorov's distribution with Stephens' small-sample correction)."""
    if not a or not b:
        raise ValueError("ks_2samp needs two non-empty samples")
    sa, sb = sorted(a), sorted(b)
    d = 0.0
    for x in sa + sb:
        fa = bisect.bisect_right(sa, x) / len(sa)
        fb = bisect.bisect_right(sb, x) / len(sb)
        d = max(d, abs(fa - fb))
    ne = len(sa) * len(sb) / (len(sa) + len(sb))
    lam = (math.sqrt(ne) + 0.12 + 0.11 / math.sqrt(ne)) * d
    return d, _kolmogorov_q(lam)


def _kolmogorov_q(lam: float) -> float:
    """P(K > lam) for the Kolmogorov distribution."""
    if lam < 1e-3:
        return 1.0
    total = sum(2 * (-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return min(1.0, max(0.0, total))
