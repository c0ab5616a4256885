"""Probe `timing`: does a prompt that another tenant sent answer faster (a prefix cache shared
across tenants, the leak behind prompt-stealing attacks)? A positive control within one tenant
comes first; without a measurable hit there, nothing is concluded across tenants.

Each pair: the primer sends a fresh random prefix of P tokens (timing_prompts.py: words of the
server's own vocabulary, checked to differ as tokens); then the sender sends that prefix
(a hit if the cache is shared with the primer) and another fresh one of equal length, in random
order. Pairs of all arms are interleaved in random order and sent one at a time. The time is to
the first SSE event where the server streams, else the whole (1-token) request."""

from __future__ import annotations

import random
import string
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kvfence.tools.leakcheck.cases import Kind, State
from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run
from kvfence.tools.leakcheck.timing_prompts import fresh_pair, make_prompts
from kvfence.tools.leakcheck.timing_result import ArmResult, Decision, TimingResult
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
    made = await make_prompts(run, arm_list[0].primer)
    if isinstance(made, str):
        run.cases.set_probe(PROBE, State.INCONCLUSIVE, made)
        run.timing = TimingResult(
            p_tokens, "nothing timed", "none", s.timing_alpha, s.timing_auc_floor,
            Decision.INCONCLUSIVE, made,
        )  # fmt: skip
        return
    samples: dict[str, dict[str, list[float]]] = {
        a.name: {"hit": [], "fresh": []} for a in arm_list
    }
    schedule = [a for a in arm_list for _ in range(pairs)]
    run.rng.shuffle(schedule)
    stream = True
    unchecked = 0
    for arm in schedule:
        if run.left < PER_PAIR or time.monotonic() > run.deadline:
            run.stopped_early = run.stopped_early or (
                "duration" if time.monotonic() > run.deadline else None
            )
            break
        # Sized by the server's own count where it tokenizes; else errs short by characters.
        pair = await fresh_pair(run, arm.primer, made, p_tokens, t.chars_per_token)
        if pair is None:
            unchecked += 1
            continue
        prefix, other = pair
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
    if unchecked:
        run.notes.append(f"timing: {unchecked} pairs left out: their prompts shared a first token")
    run.timing = _decide(run, arm_list, samples, p_tokens, stream, made.how)


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
    prompts: str,
) -> TimingResult:
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
    decision, verdict = _verdict(arm_list, stats, findings, pwr)
    for arm in arm_list:
        st = stats[arm.name]
        got = samples[arm.name]
        case = run.cases.get(PROBE, arm.name, Kind.READ)
        case.requests = case.judged = min(len(got["hit"]), len(got["fresh"])) * PER_PAIR
        if st is None:
            case.forced, case.reason = State.INCONCLUSIVE, f"fewer than {MIN_PAIRS} pairs timed"
        elif arm.must_share and not st.detected:
            case.forced, case.reason = State.INCONCLUSIVE, "no prefix caching detected"
        elif decision is Decision.INCONCLUSIVE and not arm.must_share:
            case.forced, case.reason = State.INCONCLUSIVE, verdict
    arms_out = tuple(
        ArmResult(
            a.name,
            a.primer.name,
            a.sender.name,
            (a.prime_salt, a.send_salt) if a.prime_salt else None,
            a.must_share,
            tuple(samples[a.name]["hit"]),
            tuple(samples[a.name]["fresh"]),
            stats[a.name],
        )
        for a in arm_list
    )
    result = TimingResult(
        prefix_tokens=p_tokens,
        measure="time to first SSE event" if stream else "whole request (max_tokens 1)",
        prompts=prompts,
        alpha=s.timing_alpha,
        auc_floor=s.timing_auc_floor,
        decision=decision,
        verdict=verdict,
        arms=arms_out,
        control_saw_caching=bool(control and control.detected),
        power=pwr,
    )
    if s.report:
        result = replace(result, plot=_plot(result, Path(s.report).parent, run.notes))
    return result


def _verdict(
    arm_list: list[Arm],
    stats: dict[str, ArmStats | None],
    findings: list[Arm],
    pwr: float | None,
) -> tuple[Decision, str]:
    if findings:
        what = "; ".join(
            f"{a.name}: AUC {st.auc:.2f} [{st.auc_ci[0]:.2f}, {st.auc_ci[1]:.2f}], KS p "
            f"{st.ks_p:.2g}"
            for a in findings
            if (st := stats[a.name]) is not None
        )
        return Decision.FINDING, f"shares cache across tenants ({what})"
    control = stats[CONTROL]
    if control is None:
        return (
            Decision.INCONCLUSIVE,
            "too few timed pairs for the positive control; nothing concluded",
        )
    if not control.detected:
        return Decision.INCONCLUSIVE, "no prefix caching detected; cross-tenant result inconclusive"
    if not any(not a.must_share for a in arm_list):
        return Decision.INCONCLUSIVE, "one tenant: the cross-tenant arm needs a second API key"
    if any(stats[a.name] is None for a in arm_list):
        return (
            Decision.INCONCLUSIVE,
            "an arm got too few timed pairs; nothing concluded across tenants",
        )
    assert pwr is not None
    if pwr < POWER_WANTED:
        return Decision.INCONCLUSIVE, (
            f"no sharing detected, but with too little power ({pwr:.2f} < {POWER_WANTED}): a hit "
            "of the size seen within a tenant could have been missed; raise --requests"
        )
    return Decision.CLEAN, (
        "no sharing detected (power: a hit of the size seen within a tenant would have been "
        f"found with probability {pwr:.2f} >= {POWER_WANTED})"
    )


def _plot(result: TimingResult, folder: Path, notes: list[str]) -> str | None:
    """Hit and fresh time distributions per arm, when matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        notes.append("timing: no plot (matplotlib is not installed: pip install matplotlib)")
        return None
    arms_ = result.arms
    fig, axes = plt.subplots(1, len(arms_), figsize=(4 * len(arms_), 3), squeeze=False)
    for ax, arm in zip(axes[0], arms_, strict=True):
        for kind, values in (("hit", arm.hit_s), ("fresh", arm.fresh_s)):
            ax.hist([v * 1000 for v in values], bins=20, alpha=0.6, label=kind)
        ax.set_title(arm.name)
        ax.set_xlabel("ms")
        ax.legend()
    fig.suptitle(result.verdict[:100], fontsize=8)
    path = folder / "leakcheck-timing.png"
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
