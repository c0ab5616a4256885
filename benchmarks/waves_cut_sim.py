"""A model, not a measurement: waves.py's cuts (issue 43, C=32) priced in benchmarks/waves_sim.py's
closed loop, the scheduler's policy with them (`--ttft-cuts`) against the one before them
(the default), C=8 and C=32, 48 prompts 256 -> 64, `--target-tpot-ms 50 --target-ttft-ms 4000`
as goodput.py runs it, every step x a lognormal(0, --noise) draw, medians over --seeds: the
SLO grid, TTFT p50, ITL p99, TPOT p50 and throughput, per cost (waves_sim.COSTS: "epyc" and
"measured" are C=8 fits, "c32" / "c32-bf16" C=32 ones). `too_big` counts the steps where
waves.mode said OFF with prompts waiting, the only place a cut can start: 0 at C=8, so C=8 is
the same policy.

Why a cut and not another way (the same loop, each candidate priced before the scheduler got
one; C=32 fp32, "epyc" / "c32" costs, against the policy before it): a wave of the prompts that
can be on time whose streams then decode alone (the others waiting for the drain) lifted the 4 s
x 100 ms cell to 1.0 / 1.25 req/s but lost 12% / 12% of the throughput: each wave's ~12 rows
pay the decode step's fixed cost (the weights' read) for few tokens. Letting the others ride
beside it at up to 2x the TPOT target still lost 6% / 6%, at 4x kept throughput but lost the
goodput (0.21 / 0.10 against 0.34 / 0.48). What holds both is the cut: its prompts hold their
first tokens while whole chunks compute the backlog beside every stream's decode (so the backlog
lands in their TTFT, within the target, not in their TPOT), and the other prompts are never
held back (work-conserving: the decode batch stays full). Its share of the target
(waves.CUT_SHARE) traded the cells: 0.75 lost bf16's 2 s x 100 ms cell (the cut's first tokens
all came near 4 s), 0.4-0.6 priced alike.

    .venv/bin/python benchmarks/waves_cut_sim.py [--costs epyc c32 c32-bf16] [--noise 0.1]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks import waves_sim  # noqa: E402
from benchmarks.common import RESULTS, machine, this_command, write_json  # noqa: E402
from kvfence.engine.step_budget import BudgetPolicy, StepCost  # noqa: E402
from kvfence.engine.waves import Wave  # noqa: E402

SHOWN = ("tput", "ttft50", "itl99", "tpot50")


def too_big(c: int, n_prompts: int, policy: BudgetPolicy, cost: StepCost) -> int:
    """Steps of the policy before cuts where waves.mode says OFF with prompts waiting."""
    seen = [0]
    mode = waves_sim.mode

    def spy(filling, streams, prompts, *rest) -> Wave:  # noqa: ANN001
        prompts = list(prompts)
        w = mode(filling, streams, prompts, *rest)
        seen[0] += w is Wave.OFF and bool(prompts)
        return w

    waves_sim.mode = spy
    try:
        waves_sim.sim(c, n_prompts, policy, cost)
    finally:
        waves_sim.mode = mode
    return seen[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--costs", nargs="+", default=["epyc", "measured", "c32", "c32-bf16"],
                   choices=sorted(waves_sim.COSTS))
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--noise", type=float, default=0.1, help="lognormal sigma per step")
    p.add_argument("--seeds", type=int, default=5, help="median figures over seeds")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="waves_cut_sim")
    a = p.parse_args(argv)
    policy = BudgetPolicy(waves_sim.CHUNK, 32, backlog_steps=16, wide_factor=6.0,
                          target_tpot_ms=50.0, target_ttft_ms=4000.0)
    rows: list[dict] = []
    for name in a.costs:
        cost = waves_sim.COSTS[name]
        for c in (8, 32):
            for label, cuts in (("before", False), ("cuts", True)):
                pol = dataclasses.replace(policy, ttft_cuts=cuts)
                runs = [
                    waves_sim.sim(c, a.prompts, pol, cost, noise=a.noise, seed=s)
                    for s in range(a.seeds)
                ]
                r = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                r["too_big"] = too_big(c, a.prompts, policy, cost)
                rows.append({"cost": name, "concurrency": c, "policy": label, **r})
                shown = {k: round(r[k]) for k in SHOWN}
                grid = " ".join(f"{v:.2f}" for k, v in r.items() if k.startswith("good"))
                print(f"{name:<9} C={c:<2} {label:<6} {shown} grid {grid} too_big {r['too_big']}",
                      flush=True)
    write_json(Path(a.out) / f"{a.name}.json", {
        "command": this_command(), "machine": machine(), "noise": a.noise, "seeds": a.seeds,
        "grid": [f"{ts}s x {tp}ms" for ts, tp in waves_sim.GRID],
        "costs": {n: vars(waves_sim.COSTS[n]) for n in a.costs}, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
