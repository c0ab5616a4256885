"""A model, not a measurement: 1 prefill + 1 decode worker on one core each, a closed-loop client
(C in flight, L_in -> L_out tokens), and the decode worker's choice of where a prompt is computed
(kvfence/pd/local_prefill.py), against kvfence serve on both cores
(benchmarks/step_budget_sim.py's unified model). Simulated clocks; the step costs are the
unified model's (a quiet 2-thread host) and, for one thread, those scaled by ONE_THREAD (an
assumption: a 512-token prefill step parallelises near 2x, a small decode step less). It prices
routing rules where the shared 2-core machine cannot (its load moves every real run by up to
7x, and a loaded host slows a 2-thread server far more than two 1-thread workers).

    .venv/bin/python benchmarks/pd_local_sim.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks import step_budget_sim  # noqa: E402
from benchmarks.common import RESULTS, machine, this_command, write_json  # noqa: E402
from kvfence.engine.step_budget import BudgetPolicy, StepCost, prefill_budget  # noqa: E402
from kvfence.pd.local_prefill import LocalPace, computes_here  # noqa: E402

ONE_THREAD = (1.3, 1.9, 1.7)  # a, b, c of one thread over two
TRANSFER_MS = 20.0  # RESERVE -> DONE -> commit beyond the prefill compute
CHUNK = 512


def one_thread(cost: StepCost) -> StepCost:
    fa, fb, fc = ONE_THREAD
    return StepCost(cost.a * fa, cost.b * fb, cost.c * fc)


Rule = Callable[[int, int, int, LocalPace | None], bool]


def pd_sim(c: int, n: int, rule: Rule, d_policy: BudgetPolicy, cost: StepCost,
           lin: int = 256, lout: int = 64) -> dict[str, float]:  # fmt: skip
    """One run: returns throughput (tok/s), TTFT p50 (ms), ITL p99 (ms), goodput at 2 s x 100
    ms (req/s) and the share of prompts computed on the decode worker."""
    t_p = t_d = 0.0  # each worker's clock: when it is next free
    p_queue: list[dict] = []  # prompts at the prefill worker, FIFO
    local: list[dict] = []  # prompts the decode computes, FIFO
    rows: list[dict] = []  # streams decoding on the decode worker
    arriving: list[dict] = []  # KV on its way: joins `rows` at its time
    started = 0
    done: list[dict] = []
    itl: list[float] = []
    here = there = 0
    n_local = 0

    def pace(n_rows: int) -> LocalPace:
        budget = prefill_budget(d_policy, cost, n_rows) if n_rows else CHUNK
        return LocalPace.of(cost, n_rows, budget, CHUNK)

    def issue(t: float) -> None:
        nonlocal started, here, there, n_local
        while started < n and started - len(done) < c:
            r = {"arr": t, "unc": lin, "out": 0}
            started += 1
            phantom = len(p_queue) + len(arriving)
            if rule(here, there, lin, pace(len(rows) + phantom)):
                here += lin
                n_local += 1
                local.append(r)
            else:
                there += lin
                p_queue.append(r)

    issue(0.0)
    while len(done) < n:
        # The prefill worker runs whenever it has work and is the earlier clock.
        d_busy = bool(rows or local or arriving)
        if p_queue and (t_p <= t_d or not d_busy):
            t_p = max(t_p, min(r["arr"] for r in p_queue))
            budget, finished = CHUNK, []
            for r in p_queue:
                k = min(r["unc"], budget)
                r["unc"] -= k
                budget -= k
                if r["unc"] == 0:
                    finished.append(r)
                if budget == 0:
                    break
            t_p += cost.predict(CHUNK - budget, 0)
            for r in finished:
                p_queue.remove(r)
                r["first"] = r["last"] = t_p + TRANSFER_MS
                arriving.append(r)
            continue
        if not d_busy:
            break  # nothing anywhere (cannot happen while prompts remain)
        t_d = max(t_d, min([r["arr"] for r in local] + [r["first"] for r in arriving] + [t_d]))
        for r in [r for r in arriving if r["first"] <= t_d]:
            arriving.remove(r)
            there -= lin
            r["out"] = 1
            rows.append(r)
        if not rows and not local:
            t_d = min(r["first"] for r in arriving)
            continue
        phantom = len(p_queue) + len(arriving)
        n_rows = len(rows) + phantom
        backlog = sum(r["unc"] for r in local)
        budget = prefill_budget(d_policy, cost, n_rows, backlog) if rows or phantom else CHUNK
        ptoks, firsts = 0, []
        for r in local:
            if budget == 0:
                break
            k = min(r["unc"], budget)
            r["unc"] -= k
            budget -= k
            ptoks += k
            if r["unc"] == 0:
                firsts.append(r)
        t_d += cost.predict(ptoks, len(rows))
        for r in rows:
            r["out"] += 1
            itl.append(t_d - r["last"])
            r["last"] = t_d
        for r in firsts:
            local.remove(r)
            here -= lin
            r["first"] = r["last"] = t_d
            r["out"] = 1
            rows.append(r)
        for r in [r for r in rows if r["out"] >= lout]:
            rows.remove(r)
            r["end"] = t_d
            done.append(r)
        issue(t_d)
    end = max(r["end"] for r in done)
    ttft = sorted(r["first"] - r["arr"] for r in done)
    good = sum(
        r["first"] - r["arr"] <= 2000 and (r["end"] - r["first"]) / (lout - 1) <= 100 for r in done
    )
    itl.sort()
    return {
        "tput": n * (lin + lout) / end * 1000,
        "ttft50": ttft[len(ttft) // 2],
        "itl99": itl[min(len(itl) - 1, int(0.99 * len(itl)))] if itl else 0.0,
        "good_2s_100ms": good / end * 1000,
        "local_share": n_local / n,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="pd_local_sim")
    p.add_argument("--scale", type=float, default=1.0, help="every step cost times this")
    a = p.parse_args(argv)
    base = step_budget_sim.COST
    step_budget_sim.COST = StepCost(base.a * a.scale, base.b * a.scale, base.c * a.scale)
    cost1 = one_thread(step_budget_sim.COST)
    narrow = BudgetPolicy(CHUNK, 32, backlog_steps=16, wide_factor=2.0)
    no_floor = BudgetPolicy(CHUNK, 32, backlog_steps=None, wide_factor=2.0)
    serve = BudgetPolicy(CHUNK, 32, backlog_steps=16, wide_factor=6.0)

    def limited(chunks: float) -> Rule:
        return lambda h, t, p, _: computes_here(h, t, p, 1.0, int(chunks * CHUNK))

    def paced(h: int, t: int, p: int, pace: LocalPace | None) -> bool:
        return computes_here(h, t, p, 1.0, 1 << 62, pace)

    rules: list[tuple[str, Rule, BudgetPolicy]] = [
        ("main: tokens, 1-chunk limit", limited(1), narrow),
        ("tokens, no limit", limited(1 << 40), narrow),
        ("paced, no limit", paced, narrow),
        ("paced, no backlog floor", paced, no_floor),
    ]
    rows: list[dict] = []
    for c in (8, 32):
        for n in (32, 48, 64):
            s = step_budget_sim.sim(c, n, policy=serve)
            s_good = s["good_2s_100ms"]
            print(f"C={c} n={n} serve: tput {s['tput']:.0f} good {s_good:.2f} "
                  f"ttft50 {s['ttft50']:.0f} "
                  f"itl99 {s['itl99']:.0f}")  # fmt: skip
            for label, rule, pol in rules:
                r = pd_sim(c, n, rule, pol, cost1)
                r["up_over_serve_good"] = r["good_2s_100ms"] / s_good if s_good else float("inf")
                rows.append({"concurrency": c, "prompts": n, "rule": label, **r})
                shown = {k: round(v, 2) for k, v in r.items()}
                print(f"  {label:<30}", shown, flush=True)
    write_json(
        Path(a.out) / f"{a.name}.json",
        {"command": this_command(), "machine": machine(), "one_thread": ONE_THREAD, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
