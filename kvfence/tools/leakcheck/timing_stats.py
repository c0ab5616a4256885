"""The statistics behind leakcheck's timing probe, with no dependency beyond numpy: AUC (the
chance that a fresh prompt is slower than a cached one) with a bootstrap CI, the exact two-sample
Kolmogorov-Smirnov p-value, one decision rule for "this arm shows cache hits", and that rule's
power against an effect of the size the positive control saw."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Exact KS path counting up to this many grid points; past it, the asymptotic series.
_EXACT_KS_LIMIT = 40_000


def auc(hits: np.ndarray, fresh: np.ndarray) -> float:
    """P(fresh > hit) + P(tie) / 2: 0.5 when the two look alike, 1.0 when every hit is faster."""
    diff = fresh[:, None] - hits[None, :]
    return float(((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size)


def _auc_rows(hits: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """AUC of each row pair: hits (B, n), fresh (B, m) -> (B,)."""
    diff = fresh[:, :, None] - hits[:, None, :]
    return ((diff > 0).sum(axis=(1, 2)) + 0.5 * (diff == 0).sum(axis=(1, 2))) / (
        diff.shape[1] * diff.shape[2]
    )


def auc_ci(
    hits: np.ndarray, fresh: np.ndarray, rng: np.random.Generator, rounds: int = 2000
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the AUC (each arm resampled on its own)."""
    h = hits[rng.integers(0, len(hits), (rounds, len(hits)))]
    f = fresh[rng.integers(0, len(fresh), (rounds, len(fresh)))]
    values = _auc_rows(h, f)
    return float(np.quantile(values, 0.025)), float(np.quantile(values, 0.975))


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    both = np.concatenate([a, b])
    cdf_a = np.searchsorted(np.sort(a), both, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), both, side="right") / len(b)
    return float(np.max(np.abs(cdf_a - cdf_b)))


def ks_pvalue(d: float, n: int, m: int) -> float:
    """P(D >= d) for two independent samples of sizes n and m from one distribution (two-sided).

    Exact by counting monotone lattice paths from (0, 0) to (n, m) that stay strictly inside
    |i/n - j/m| < d (every ordering of the pooled sample is equally likely under the null);
    the asymptotic Kolmogorov series with Stephens' small-sample correction past the limit."""
    if d <= 0:
        return 1.0
    if (n + 1) * (m + 1) > _EXACT_KS_LIMIT:
        en = math.sqrt(n * m / (n + m))
        lam = (en + 0.12 + 0.11 / en) * d
        p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
        return min(1.0, max(0.0, p))
    # |i*m - j*n| < d*n*m in integers: d is a multiple of 1/lcm(n, m), so round it exactly.
    bound = round(d * n * m)
    # Path probabilities instead of counts: each step goes right with the chance that the next
    # draw (of those left) comes from the first sample, so nothing overflows.
    row = np.zeros(m + 1)
    row[0] = 1.0
    for j in range(1, m + 1):
        row[j] = row[j - 1] * (m - j + 1) / (n + m - j + 1) if abs(j * n) < bound else 0.0
    for i in range(1, n + 1):
        new = np.zeros(m + 1)
        for j in range(m + 1):
            if abs(i * m - j * n) >= bound:
                continue
            left = n + m - i - j + 1  # draws left before this step
            from_up = row[j] * (n - i + 1) / left
            from_left = new[j - 1] * (m - j + 1) / left if j else 0.0
            new[j] = from_up + from_left
        row = new
    return float(min(1.0, max(0.0, 1.0 - row[m])))


@dataclass(frozen=True)
class ArmStats:
    pairs: int
    hit_median: float
    fresh_median: float
    auc: float
    auc_ci: tuple[float, float]
    ks_d: float
    ks_p: float
    detected: bool  # hits measurably faster: AUC CI above the threshold and KS p < alpha


def arm_stats(
    hits: list[float],
    fresh: list[float],
    rng: np.random.Generator,
    *,
    alpha: float,
    auc_floor: float,
) -> ArmStats:
    h = np.asarray(hits, dtype=float)
    f = np.asarray(fresh, dtype=float)
    lo, hi = auc_ci(h, f, rng)
    d = ks_statistic(h, f)
    p = ks_pvalue(d, len(h), len(f))
    a = auc(h, f)
    return ArmStats(
        pairs=min(len(h), len(f)),
        hit_median=float(np.median(h)),
        fresh_median=float(np.median(f)),
        auc=a,
        auc_ci=(lo, hi),
        ks_d=d,
        ks_p=p,
        detected=lo > auc_floor and p < alpha,
    )


def power(
    hits: list[float],
    fresh: list[float],
    n: int,
    rng: np.random.Generator,
    *,
    alpha: float,
    auc_floor: float,
    trials: int = 200,
    rounds: int = 400,
) -> float:
    """The chance that an arm of `n` pairs drawn from these samples (the positive control's)
    meets the detection rule: how likely an effect of the control's size would have been seen."""
    h = np.asarray(hits, dtype=float)
    f = np.asarray(fresh, dtype=float)
    found = 0
    for _ in range(trials):
        sh = h[rng.integers(0, len(h), n)]
        sf = f[rng.integers(0, len(f), n)]
        bh = sh[rng.integers(0, n, (rounds, n))]
        bf = sf[rng.integers(0, n, (rounds, n))]
        lo = float(np.quantile(_auc_rows(bh, bf), 0.025))
        if lo > auc_floor and ks_pvalue(ks_statistic(sh, sf), n, n) < alpha:
            found += 1
    return found / trials
