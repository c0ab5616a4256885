"""A model, not a measurement: a closed-loop client (C in flight, L_in -> L_out tokens) against
the scheduler's prefill policy (FIFO prompts, decodes first, the prefill budget of
kvfence/engine/step_budget.py itself) on a fixed step cost, with a simulated clock. It prices
the policy's defaults where the shared 2-core machine cannot (its load moves every real run by
up to 7x); the step cost is this model's on a quiet machine (a 48 ms 8-row decode step, a
92 ms 32-row one, ~1.1 ms a prefill token, measured on the first Xeon host), and the base
policy's figures reproduce that host's measured ones (C=8: 484 vs 491 tok/s, ITL p99 607 vs
590 ms).

    .venv/bin/python benchmarks/step_budget_sim.py
"""

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

COST = StepCost(a=33.0, b=1.1, c=1.8)  # ms


def sim(C, n_prompts, lin=256, lout=64, policy=None, fixed=None):
    t = 0.0
    pending = list(range(n_prompts))
    waiting = []  # [id, uncomputed, arrival]
    running = []  # dicts
    done = 0
    ttft, itl, last, met = [], [], {}, []

    def deadlines(policy, dec, t):
        """What the scheduler would measure against the policy's targets (times in s there)."""
        if policy.target_tpot_ms is None and policy.target_ttft_ms is None:
            return None
        slack = None
        if policy.target_tpot_ms is not None:
            rows = [(s["first"] / 1000, s["out"]) for s in dec]
            slack = tpot_slack_ms(policy.target_tpot_ms, rows, t / 1000)
        prompts, cum = [], 0
        if policy.target_ttft_ms is not None:
            for s in [x for x in running if x["unc"] > 0] + waiting:
                cum += s["unc"]
                prompts.append((cum, s["arr"] - t + policy.target_ttft_ms))
        return Deadlines(slack, tuple(prompts))

    def refill():
        while pending and len(waiting) + len(running) < C:
            i = pending.pop(0)
            waiting.append({"id": i, "unc": lin, "arr": t, "out": 0})

    refill()
    total_tokens = n_prompts * (lin + lout)
    while done < n_prompts:
        dec = [s for s in running if s["unc"] == 0]
        pre = [s for s in running if s["unc"] > 0]
        rows = len(dec)
        backlog = sum(s["unc"] for s in pre) + sum(s["unc"] for s in waiting)
        if fixed is not None:
            budget = fixed if rows else 512
        else:
            budget = prefill_budget(policy, COST, rows, backlog, 0.0, deadlines(policy, dec, t))
        ptoks = 0
        for s in pre:
            n = min(s["unc"], budget)
            s["unc"] -= n
            budget -= n
            ptoks += n
            s["just"] = n > 0 and s["unc"] == 0
        while budget > 0 and waiting:
            s = waiting.pop(0)
            running.append(s)
            n = min(s["unc"], budget)
            s["unc"] -= n
            budget -= n
            ptoks += n
            s["just"] = s["unc"] == 0
        t += COST.predict(ptoks, rows)
        for s in dec:
            s["out"] += 1
            itl.append(t - last[s["id"]])
            last[s["id"]] = t
        for s in running:
            if s.get("just"):
                s["just"] = False
                s["out"] = 1
                s["first"] = t
                ttft.append(t - s["arr"])
                last[s["id"]] = t
        fin = [s for s in running if s["out"] >= lout]
        for s in fin:
            running.remove(s)
            done += 1
            met.append((s["first"] - s["arr"], (t - s["first"]) / (lout - 1)))
        refill()

    def q(xs, p):
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]

    return dict(
        tput=total_tokens / t * 1000,
        ttft50=statistics.median(ttft),
        itl50=statistics.median(itl),
        itl99=q(itl, 0.99),
        # requests per second within (TTFT s, TPOT ms), as benchmarks/goodput.py counts them
        **{
            f"good_{ts:g}s_{tp:g}ms": sum(a <= ts * 1000 and b <= tp for a, b in met) / t * 1000
            for ts in (1, 2)
            for tp in (50, 100)
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="step_budget_sim")
    a = p.parse_args(argv)
    rows: list[dict] = []
    for c in (8, 32):
        for n in (48, 64):
            cases: list[tuple[str, dict]] = [
                ("main (512 beside decodes)", {"fixed": 512}),
                ("fixed 64-token cap", {"fixed": 64}),
            ]
            for h in (4, 8, 16, 32, None):
                pol = BudgetPolicy(max_chunk=512, min_chunk=32, backlog_steps=h)
                cases.append((f"auto, backlog/{h}", {"policy": pol}))
            for tpot, ttft in ((50, 1000), (100, 2000), (50, None)):
                pol = BudgetPolicy(512, 32, backlog_steps=16, target_tpot_ms=tpot,
                                   target_ttft_ms=ttft)  # fmt: skip
                cases.append((f"targets {tpot} ms, {ttft} ms", {"policy": pol}))
            for label, kw in cases:
                r = sim(c, n, **kw)
                rows.append({"concurrency": c, "prompts": n, "policy": label, **r})
                shown = {k: round(v, 2 if k.startswith("good") else 0) for k, v in r.items()}
                print(f"C={c} n={n} {label:<28}", shown, flush=True)
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "cost_ms": {"a": COST.a, "b": COST.b, "c": COST.c},
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
