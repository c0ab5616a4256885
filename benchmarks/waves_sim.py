"""A model, not a measurement: benchmarks/step_budget_sim.py's closed-loop client (C in flight,
L_in -> L_out, a simulated clock, a fixed step cost) against the scheduler with both latency
targets set, where prompts are computed in waves (kvfence/engine/waves.py's own `mode`), next
to the step budget alone. It prices the policy where the shared 2-core machine cannot, in the
figures goodput reads: the SLO grid, TTFT p50, ITL p99, TPOT p50. Steps as the scheduler makes
them: a FILL step computes whole chunks with no decode row and holds every prompt's last token
but the wave leader's; the step after the fill (RELEASE) computes the held tokens and decodes
the leader; a FILL step also gives a held prompt its first token early when
waves.early_firsts allows; DEFER admits nothing; OFF is the step budget.

    .venv/bin/python benchmarks/waves_sim.py [--cost epyc]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import RESULTS, machine, this_command, write_json  # noqa: E402
from kvfence.engine.deadlines import tpot_slack_ms  # noqa: E402
from kvfence.engine.step_budget import (  # noqa: E402
    BudgetPolicy,
    Deadlines,
    StepCost,
    prefill_budget,
)
from kvfence.engine.waves import Wave, early_firsts, mode  # noqa: E402

# step_budget_sim's Xeon-A cost, and one matched to EPYC's C=8 figures (a 256-token prompt
# ~360 ms, an 8-row decode-only step ~35 ms: benchmarks/RESULTS.md "Goodput against vLLM").
COSTS = {"xeon": StepCost(a=33.0, b=1.1, c=1.8), "epyc": StepCost(a=25.0, b=1.3, c=1.2)}
CHUNK = 512
GRID = [(ts, tp) for ts in (1, 2, 4) for tp in (50, 100, 200)]


def sim(c: int, n_prompts: int, policy: BudgetPolicy, cost: StepCost, lin=256, lout=64) -> dict:
    waves = policy.target_tpot_ms is not None and policy.target_ttft_ms is not None
    t, issued, done = 0.0, 0, 0
    waiting: list[dict] = []
    running: list[dict] = []
    ttft, itl, met = [], [], []
    filling, leader = False, None
    firsts_early: list[dict] = []  # the wave's streams beside its leader, while it fills

    def refill() -> None:
        nonlocal issued
        while issued < n_prompts and len(waiting) + len(running) < c:
            waiting.append({"id": issued, "unc": lin, "arr": t, "out": 0})
            issued += 1

    refill()
    while done < n_prompts:
        streams = [s for s in running if s["out"] > 0]
        prompts = [s for s in running if s["out"] == 0] + waiting
        w = Wave.OFF
        if waves:
            wave = [leader, *firsts_early]
            left = [lout - s["out"] for s in streams if not (filling and s in wave)]
            work = [(s["unc"], s["arr"] - t + policy.target_ttft_ms) for s in prompts]
            filled = all(s["unc"] <= 1 for s in running if s["out"] == 0) and not waiting
            w = mode(filling, left, work, cost, CHUNK, filled)
            if w is Wave.FILL and not filling:
                leader, firsts_early = None, []
            filling = w is Wave.FILL
        # Decode rows: streams, and prompts whose last token is all that is left (held).
        rows = [] if w is Wave.FILL else [s for s in running if s["unc"] <= 1 and (
            s["out"] > 0 or s["unc"] == 1)]
        if w is Wave.FILL:
            budget = CHUNK
        else:
            pre = [s for s in running if s["unc"] > 1]
            backlog = sum(s["unc"] for s in pre + waiting)
            dl = None
            if policy.target_tpot_ms is not None or policy.target_ttft_ms is not None:
                slack = tpot_slack_ms(policy.target_tpot_ms or 1e9, [
                    (s["first"] / 1000, s["out"]) for s in streams], t / 1000)
                cum, ps = 0, []
                for s in pre + waiting:
                    cum += s["unc"]
                    ps.append((cum, s["arr"] - t + (policy.target_ttft_ms or 1e12)))
                dl = Deadlines(slack, tuple(ps) if policy.target_ttft_ms else ())
            budget = prefill_budget(policy, cost, len(rows), backlog, 0.0, dl)
        ptoks, firsts = 0, []

        def take(s: dict, w: Wave = w, firsts: list = firsts) -> None:
            nonlocal budget, ptoks, leader
            n = min(s["unc"], budget)
            if w is Wave.FILL and n == s["unc"]:
                if leader is None:
                    leader = s
                else:
                    n -= 1  # held: its first token waits for the wave
            s["unc"] -= n
            budget -= n
            ptoks += n
            if n and s["unc"] == 0:
                firsts.append(s)

        for s in [s for s in running if s["unc"] > 1 or (w is Wave.FILL and s["out"] == 0
                                                          and s["unc"] > 0)]:
            if budget > 0 and s not in rows:
                take(s)
        may_admit = w not in (Wave.DEFER, Wave.RELEASE)
        while may_admit and budget > 0 and waiting:
            s = waiting.pop(0)
            running.append(s)
            take(s)
        held = [s for s in running if s["out"] == 0 and s["unc"] == 1 and s not in firsts]
        if w is Wave.FILL and ptoks and held:
            rest = sum(max(0, s["unc"] - 1) for s in running if s["out"] == 0)
            rest += sum(s["unc"] for s in waiting)
            size = len(firsts_early) + len(waiting) + sum(s["out"] == 0 for s in running)
            size += leader is not None and leader["out"] > 0
            n = early_firsts(
                cost, CHUNK, rest, size, lout - 1, policy.target_tpot_ms, len(firsts_early)
            )
            for s in held[:n]:
                s["unc"], ptoks = 0, ptoks + 1
                firsts.append(s)
                firsts_early.append(s)
        if w is Wave.FILL and not ptoks:
            filling = False  # nothing more can join: the wave starts
        t += cost.predict(ptoks, len(rows))
        for s in rows:
            if s["out"] == 0:
                s["unc"] = 0
                firsts.append(s)
            else:
                s["out"] += 1
                itl.append(t - s["last"])
                s["last"] = t
        for s in firsts:
            s["out"], s["first"], s["last"] = 1, t, t
            ttft.append(t - s["arr"])
        for s in [s for s in running if s["out"] >= lout]:
            running.remove(s)
            done += 1
            met.append((s["first"] - s["arr"], (t - s["first"]) / (lout - 1)))
        refill()

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]

    return dict(
        tput=n_prompts * (lin + lout) / t * 1000,
        ttft50=statistics.median(ttft),
        itl99=q(itl, 0.99),
        tpot50=statistics.median(b for _, b in met),
        **{
            f"good_{ts}s_{tp}ms": sum(a <= ts * 1000 and b <= tp for a, b in met) / t * 1000
            for ts, tp in GRID
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cost", choices=sorted(COSTS), default="epyc")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="waves_sim")
    a = p.parse_args(argv)
    cost = COSTS[a.cost]
    rows: list[dict] = []
    for c in (8, 32):
        cases = [
            ("defaults", BudgetPolicy(CHUNK, 32, backlog_steps=16)),
            ("--target-tpot-ms 50", BudgetPolicy(CHUNK, 32, backlog_steps=16, target_tpot_ms=50)),
            (
                "--target-tpot-ms 50 --target-ttft-ms 4000 (waves)",
                BudgetPolicy(CHUNK, 32, backlog_steps=16, target_tpot_ms=50, target_ttft_ms=4000),
            ),
        ]
        for label, pol in cases:
            r = sim(c, 64, pol, cost)
            rows.append({"concurrency": c, "policy": label, **r})
            shown = {k: round(v, 2 if k.startswith("good") else 0) for k, v in r.items()}
            print(f"C={c} {label:<50}", shown, flush=True)
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "cost_ms": {"a": cost.a, "b": cost.b, "c": cost.c},
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
