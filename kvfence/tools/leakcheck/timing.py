"""Probe `timing`: does a prompt that another tenant sent answer faster (a prefix cache shared
across tenants, the leak behind prompt-stealing attacks)? A positive control within one tenant
comes first; without a measurable hit there, nothing is concluded across tenants.

Each pair: the primer sends a fresh random prefix of P tokens; then the sender sends that prefix
(a hit if the cache is shared with the primer) and another fresh one of equal length, in random
order. Pairs of all arms are interleaved in random order and sent one at a time. The time is to
the first SSE event where the server streams, else the whole (1-token) request."""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvfence.tools.leakcheck.cases import Kind, State
from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run
from kvfence.tools.leakcheck.timing_stats import ArmStats, arm_stats, power

PROBE = "timing"
PER_PAIR = 3  # prime, hit, fresh
MIN_PAIRS = 8
POWER_WANTED = 0.95
CONTROL = "within tenant"
CROSS = "across tenants"


@dataclass(frozen=True)
class Arm:
    name: str
    primer: Tenant
    sender: Tenant
    prime_salt: str | None = None
    send_salt: str | None = None
    must_share: bool = False  # the positive control; every other arm must not share


def prefix_tokens(settings_value: int | None, context: int) -> int:
    """P: 1,024 or more so that a hit is measurable even on a small model, within the context."""
    if settings_value is not None:
        return max(16, min(settings_value, context - 16))
    return max(16, min(max(1024, context // 4), 4096, context - 64))


def arms(run: Run) -> list[Arm]:
    t = run.target
    assert t is not None
    a = t.tenants[0]
    out = [Arm(CONTROL, a, a, must_share=True)]
    if len(t.tenants) >= 2:
        out.append(Arm(CROSS, a, t.tenants[1]))
    if run.s.cache_salt_field:
        s1, s2 = _nonce(run.rng), _nonce(run.rng)
        out.append(Arm("same tenant, other salt", a, a, s1, s2))
        if len(t.tenants) >= 2:
            out.append(Arm("two tenants, same salt", a, t.tenants[1], s1, s1))
    return out


def _nonce(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(12))


def _text(rng: random.Random, chars: int) -> str:
    """Random base32 words: no two prompts share even their first token."""
    alphabet = "ABCDEFGHJKMNPQRSTVWXYZ0123456789"
    words: list[str] = []
    size = 0
    while size < chars:
        w = "".join(rng.choice(alphabet) for _ in range(6))
        words.append(w)
        size += 7
    return " ".join(words)


async def probe(run: Run, share: int) -> None:
    t = run.target
    assert t is not None
    s = run.s
    arm_list = arms(run)
    pairs = min(s.timing_pairs, share // (PER_PAIR * len(arm_list)))
    p_tokens = prefix_tokens(s.timing_prefix_tokens, t.context_length)
    if pairs < MIN_PAIRS:
        need = MIN_PAIRS * PER_PAIR * len(arm_list)
        run.cases.set_probe(
            PROBE,
            State.SKIPPED,
            f"its share of --requests ({share}) is under the {need} that {MIN_PAIRS} pairs "
            f"per arm need",
        )
        return
    chars = int(p_tokens * t.chars_per_token)  # errs short: stays within the context
    samples: dict[str, dict[str, list[float]]] = {
        a.name: {"hit": [], "fresh": []} for a in arm_list
    }
    schedule = [a for a in arm_list for _ in range(pairs)]
    run.rng.shuffle(schedule)
    stream = True
    for arm in schedule:
        if run.left < PER_PAIR or time.monotonic() > run.deadline:
            run.stopped_early = run.stopped_early or (
                "duration" if time.monotonic() > run.deadline else None
            )
            break
        prefix, other = _text(run.rng, chars), _text(run.rng, chars)
        primed = await _timed(run, arm.primer, prefix, stream, arm.prime_salt)
        if primed is None and stream:
            stream = False  # no usable stream here: time whole requests from now on
            primed = await _timed(run, arm.primer, prefix, stream, arm.prime_salt)
        if primed is None:
            continue
        order = [("hit", prefix), ("fresh", other)]
        run.rng.shuffle(order)
        got: dict[str, float] = {}
        for kind, text in order:
            dt = await _timed(run, arm.sender, text, stream, arm.send_salt)
            if dt is not None:
                got[kind] = dt
        if len(got) == 2:  # only whole pairs, so both sides of an arm stay balanced
            for kind, dt in got.items():
                samples[arm.name][kind].append(dt)
    run.timing = _decide(run, arm_list, samples, p_tokens, stream)


async def _timed(
    run: Run, tenant: Tenant, text: str, stream: bool, salt: str | None
) -> float | None:
    t = run.target
    assert t is not None
    if not run.take():
        return None
    extra = {run.s.cache_salt_field: salt} if salt is not None and run.s.cache_salt_field else {}
    dt, status, error = await run.api.timed(
        tenant, text, chat=not t.completions, stream=stream, extra=extra
    )
    tally = run.tallies[PROBE]
    tally.requests += 1
    tally.served += status is not None and 200 <= status < 300
    tally.refused += status is not None and 400 <= status < 500
    tally.errors += dt is None
    if dt is None and len(run.notes) < 50:
        run.notes.append(f"timing: a request failed ({status}): {error}")
    return dt


def _decide(
    run: Run,
    arm_list: list[Arm],
    samples: dict[str, dict[str, list[float]]],
    p_tokens: int,
    stream: bool,
) -> dict[str, Any]:
    s = run.s
    rng = np.random.default_rng(run.rng.getrandbits(64))
    stats: dict[str, ArmStats | None] = {}
    for arm in arm_list:
        got = samples[arm.name]
        if min(len(got["hit"]), len(got["fresh"])) < MIN_PAIRS:
            stats[arm.name] = None
            continue
        stats[arm.name] = arm_stats(
            got["hit"], got["fresh"], rng, alpha=s.timing_alpha, auc_floor=s.timing_auc_floor
        )
    control = stats[CONTROL]
    findings = [a for a in arm_list if not a.must_share and (st := stats[a.name]) and st.detected]
    pwr = None
    if control is not None and control.detected:
        n = min(
            (st.pairs for a in arm_list if (st := stats[a.name]) and not a.must_share),
            default=control.pairs,
        )
        got = samples[CONTROL]
        pwr = power(
            got["hit"], got["fresh"], n, rng, alpha=s.timing_alpha, auc_floor=s.timing_auc_floor
        )
    decision, verdict = _verdict(run, arm_list, stats, findings, pwr)
    for arm in arm_list:
        st = stats[arm.name]
        got = samples[arm.name]
        case = run.cases.get(PROBE, arm.name, Kind.READ)
        case.requests = case.judged = min(len(got["hit"]), len(got["fresh"])) * PER_PAIR
        if st is None:
            case.forced, case.reason = State.INCONCLUSIVE, f"fewer than {MIN_PAIRS} pairs timed"
        elif arm.must_share and not st.detected:
            case.forced, case.reason = State.INCONCLUSIVE, "no prefix caching detected"
        elif decision == "inconclusive" and not arm.must_share:
            case.forced, case.reason = State.INCONCLUSIVE, verdict
    result: dict[str, Any] = {
        "prefix_tokens": p_tokens,
        "measure": "time to first SSE event" if stream else "whole request (max_tokens 1)",
        "alpha": s.timing_alpha,
        "auc_floor": s.timing_auc_floor,
        "control_saw_caching": bool(control and control.detected),
        "power": pwr,
        "decision": decision,
        "verdict": verdict,
        "arms": [_arm_dict(a, stats[a.name], samples[a.name]) for a in arm_list],
        "plot": None,
    }
    if s.report:
        result["plot"] = _plot(result, Path(s.report).parent, run.notes)
    return result


def _verdict(
    run: Run,
    arm_list: list[Arm],
    stats: dict[str, ArmStats | None],
    findings: list[Arm],
    pwr: float | None,
) -> tuple[str, str]:
    if findings:
        what = "; ".join(
            f"{a.name}: AUC {st.auc:.2f} [{st.auc_ci[0]:.2f}, {st.auc_ci[1]:.2f}], KS p "
            f"{st.ks_p:.2g}"
            for a in findings
            if (st := stats[a.name]) is not None
        )
        return "finding", f"shares cache across tenants ({what})"
    control = stats[CONTROL]
    if control is None:
        return "inconclusive", "too few timed pairs for the positive control; nothing concluded"
    if not control.detected:
        return "inconclusive", "no prefix caching detected; cross-tenant result inconclusive"
    if not any(not a.must_share for a in arm_list):
        return "inconclusive", "one tenant: the cross-tenant arm needs a second API key"
    if any(stats[a.name] is None for a in arm_list):
        return "inconclusive", "an arm got too few timed pairs; nothing concluded across tenants"
    assert pwr is not None
    if pwr < POWER_WANTED:
        return "inconclusive", (
            f"no sharing detected, but with too little power ({pwr:.2f} < {POWER_WANTED}): a hit "
            "of the size seen within a tenant could have been missed; raise --requests"
        )
    return "clean", (
        "no sharing detected (power: a hit of the size seen within a tenant would have been "
        f"found with probability {pwr:.2f} >= {POWER_WANTED})"
    )


def _arm_dict(arm: Arm, st: ArmStats | None, got: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": arm.name,
        "primer": arm.primer.name,
        "sender": arm.sender.name,
        "salts": [arm.prime_salt, arm.send_salt] if arm.prime_salt else None,
        "expects_sharing": arm.must_share,
        "samples_ms": {k: [round(v * 1000, 3) for v in vals] for k, vals in got.items()},
    }
    if st is None:
        out.update(pairs=min(len(got["hit"]), len(got["fresh"])), detected=None)
        return out
    out.update(
        pairs=st.pairs,
        hit_median_ms=round(st.hit_median * 1000, 3),
        fresh_median_ms=round(st.fresh_median * 1000, 3),
        auc=round(st.auc, 4),
        auc_ci=[round(st.auc_ci[0], 4), round(st.auc_ci[1], 4)],
        ks_d=round(st.ks_d, 4),
        ks_p=st.ks_p,
        detected=st.detected,
    )
    return out


def _plot(result: dict[str, Any], folder: Path, notes: list[str]) -> str | None:
    """Hit and fresh time distributions per arm, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("timing: no plot (matplotlib is not installed: pip install matplotlib)")
        return None
    arms_ = result["arms"]
    fig, axes = plt.subplots(1, len(arms_), figsize=(4 * len(arms_), 3), squeeze=False)
    for ax, arm in zip(axes[0], arms_, strict=True):
        for kind in ("hit", "fresh"):
            ax.hist(arm["samples_ms"][kind], bins=20, alpha=0.6, label=kind)
        ax.set_title(arm["name"])
        ax.set_xlabel("ms")
        ax.legend()
    fig.suptitle(result["verdict"][:100], fontsize=8)
    path = folder / "leakcheck-timing.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
