"""A model, not a measurement: benchmarks/step_budget_sim.py's closed-loop client (C in flight,
L_in -> L_out, a simulated clock, a fixed step cost) against the scheduler with both latency
targets set, where prompts are computed in waves (kvfence/engine/waves.py's own `mode`), next
to the step budget alone. It prices the policy where the shared 2-core machine cannot, in the
figures goodput reads: the SLO grid, TTFT p50, ITL p99, TPOT p50. Steps as the scheduler makes
them: a FILL step computes whole chunks with no decode row and holds every prompt's last token
but the wave leader's; the step after the fill (RELEASE) computes the held tokens and decodes
the leader; a FILL step also gives a held prompt its first token early when
waves.early_firsts allows; DEFER admits nothing; OFF is the step budget.

The split candidate (`sim_split`, issue 43's TTFT p50 at C=8): a wave's held prompts all get
their first token once the rest of the wave fits in their TPOT target (d(C) + b * rest / 63 <=
SPLIT_MARGIN x target), and the rest of the wave then rides in the released streams' steps in
chunks that keep a step within --ride-cap-ms and every stream's projected TPOT within the margin
(prompts that arrive while streams decode ride the same way); the first prompt of each
generation (arrived after the last release) gets its first token at once. Not in the scheduler:
it buys its TTFT with the TPOT margin. A stream released while W - K of its wave's W prompt
tokens are still to come has TTFT >= b K and TPOT = d(C) + b (W - K) / 63, so TTFT p50 <= T
with TPOT <= m x target needs b W + 63 d(C) <= T - (chunk and stagger costs) + 63 m target:
with the "measured" cost (C=8, 256 -> 64: b W + 63 d = 4,590 ms) that holds at m = 0.9 and
T = 0.95 x vLLM's 2,392 ms, with the "epyc" cost (4,842 ms) only at m >= 0.92, and then steps
5% slower than the fit push the released streams past the target (4 s x 50 ms falls to ~0.7).
--early-margin / --gap-share price the waves' own early first tokens the same way.

    .venv/bin/python benchmarks/waves_sim.py [--cost measured] [--prompts 48]
        [--noise 0.1 --slower 1.05 --seeds 5] [--ride-cap-ms 65] [--early-margin 1.0]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

import numpy as np  # noqa: E402

from benchmarks.common import RESULTS, machine, this_command, write_json  # noqa: E402
from kvfence.engine import waves  # noqa: E402
from kvfence.engine.deadlines import tpot_slack_ms  # noqa: E402
from kvfence.engine.step_budget import (  # noqa: E402
    BudgetPolicy,
    Deadlines,
    StepCost,
    prefill_budget,
)
from kvfence.engine.waves import (  # noqa: E402
    Wave,
    cut,
    cut_order,
    cut_release,
    early_firsts,
    mode,
)

# step_budget_sim's Xeon-A cost, and one matched to EPYC's C=8 figures (a 256-token prompt
# ~360 ms, an 8-row decode-only step ~35 ms: benchmarks/RESULTS.md "Goodput against vLLM").
# "measured": fitted to the C=8 medians of results/goodput_waves.json (waves, EPYC): the held
# streams' TPOT p50 31.5 ms is the 8-row decode step, and a 2,048-token wave plus 63 such steps
# gives its 545 tok/s and TTFT p50 (the sim then reads 545 / 2,713 / 1.49 at 4 s x 50 ms against
# the run's 545 / 2,756 / 1.49); "epyc" has the older 35 ms decode step.
# "c32" / "c32-bf16": fitted to C=32 instead (issue 43's per-request diagnosis and RESULTS.md's
# step figures, EPYC): a 32-row decode-only step ~73 ms fp32 / ~52 ms bf16 (measured 60-80 and
# 53), prefill ~1.05 ms / 0.5 ms a token (850-1,000 tok/s fp32); the 8-row step stays ~35 ms.
COSTS = {
    "xeon": StepCost(a=33.0, b=1.1, c=1.8),
    "epyc": StepCost(a=25.0, b=1.3, c=1.2),
    "measured": StepCost(a=22.0, b=1.27, c=1.2),
    "c32": StepCost(a=22.0, b=1.05, c=1.6),
    "c32-bf16": StepCost(a=20.0, b=0.5, c=1.0),
}
SPLIT_MARGIN = 0.9  # the split candidate's predicted TPOT stays within this share of the target
RIDE_CAP_MS = 65.0  # ... and a step with decodes within this (the ITL p99 bound, 1.5 x 61 ms)
CHUNK = 512
GRID = [(ts, tp) for ts in (1, 2, 4) for tp in (50, 100, 200)]


def advance(t: float, decoding: list[dict], firsts: list[dict], running: list[dict],
            figs: tuple[list, list, list], lout: int) -> int:
    """A step ending at t: the decode rows' next tokens, the first tokens, and the streams that
    finish (removed from running; their count is returned). figs: (ttft, itl, met) to extend."""
    ttft, itl, met = figs
    for s in decoding:
        s["out"] += 1
        itl.append(t - s["last"])
        s["last"] = t
    for s in firsts:
        s["out"], s["first"], s["last"] = 1, t, t
        ttft.append(t - s["arr"])
    ended = [s for s in running if s["out"] >= lout]
    for s in ended:
        running.remove(s)
        met.append((s["first"] - s["arr"], (t - s["first"]) / (lout - 1)))
    return len(ended)


def sim(
    c: int, n_prompts: int, policy: BudgetPolicy, cost: StepCost, lin=256, lout=64,
    noise: float = 0.0, slower: float = 1.0, seed: int = 0,
) -> dict:
    """The scheduler's policy (waves.mode, its cuts with policy.ttft_cuts) in the closed loop;
    steps take `cost` x `slower` x a lognormal(0, `noise`) draw each, as in sim_split."""
    rng = np.random.default_rng(seed)
    cut_ids: set[int] = set()
    cutting = False
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
            ttft_ms = policy.target_ttft_ms
            wave = [leader, *firsts_early]
            left = [lout - s["out"] for s in streams if not (filling and s in wave)]
            work = [(s["unc"], s["arr"] - t + ttft_ms) for s in prompts]
            filled = all(s["unc"] <= 1 for s in running if s["out"] == 0) and not waiting
            if cutting:  # as Scheduler._cut_mode
                mine = [s["arr"] - t + ttft_ms for s in prompts if s["id"] in cut_ids]
                cutting = not cut_release(mine)
                w = Wave.CUT if cutting else Wave.RELEASE
            elif cut_ids & {s["id"] for s in running + waiting}:
                w, filling = Wave.OFF, False  # a cut's streams decode: the step budget
            else:
                w = mode(filling, left, work, cost, CHUNK, filled)
                if w is Wave.FILL and not filling:
                    leader, firsts_early = None, []
                filling = w is Wave.FILL
                if policy.ttft_cuts and w is Wave.OFF and work:
                    taken = cut(cost, CHUNK, work)  # as Scheduler._start_cut
                    cut_ids = {prompts[i]["id"] for i in taken}
                    cutting = bool(taken)
                    w = Wave.CUT if taken else w
        if w is Wave.CUT:  # as Scheduler._cut_step
            rows = [s for s in running if s["out"] > 0]
            running.extend(waiting)
            waiting.clear()
            todo = [s for s in running if s["out"] == 0 and s["unc"] > 1]
            work = [(s["unc"], s["arr"] - t + ttft_ms) for s in todo]
            taken = {i for i, s in enumerate(todo) if s["id"] in cut_ids}
            budget, ptoks, firsts = CHUNK, 0, []
            for i in cut_order(work, taken, ttft_ms):
                s = todo[i]
                n = min(s["unc"], budget) - (budget >= s["unc"] and i not in taken)  # held
                s["unc"], budget, ptoks = s["unc"] - n, budget - n, ptoks + n
                if s["unc"] == 0:
                    firsts.append(s)
            draw = float(rng.lognormal(0.0, noise)) if noise else 1.0
            t += cost.predict(ptoks, len(rows)) * slower * draw
            done += advance(t, rows, firsts, running, (ttft, itl, met), lout)
            refill()
            continue
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
            budget = 0 if w is Wave.RELEASE else budget  # as the scheduler's
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
        draw = float(rng.lognormal(0.0, noise)) if noise else 1.0
        t += cost.predict(ptoks, len(rows)) * slower * draw
        decoding = [s for s in rows if s["out"] > 0]
        for s in rows:
            if s["out"] == 0:
                s["unc"] = 0
                firsts.append(s)
        done += advance(t, decoding, firsts, running, (ttft, itl, met), lout)
        refill()

    return figures(n_prompts * (lin + lout), t, ttft, itl, met)


def figures(tokens: int, t: float, ttft: list, itl: list, met: list) -> dict:
    """What goodput.py reads from a run: throughput, TTFT p50, ITL p99, TPOT p50, the grid."""

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]

    return dict(
        tput=tokens / t * 1000,
        ttft50=statistics.median(ttft),
        itl99=q(itl, 0.99),
        tpot50=statistics.median(b for _, b in met),
        **{
            f"good_{ts}s_{tp}ms": sum(a <= ts * 1000 and b <= tp for a, b in met) / t * 1000
            for ts, tp in GRID
        },
    )


def released(cost: StepCost, rows: int, rest: int, out_tokens: int, target_ms: float) -> bool:
    """Whether a held prompt may have its first token now: its TPOT holds even if all `rest`
    prompt tokens still to compute ride in its gaps, at `rows` decode rows a step."""
    return cost.predict(0, rows) + cost.b * rest / out_tokens <= SPLIT_MARGIN * target_ms


def ride_tokens(
    cost: StepCost, rows: int, rows_later: int, streams: list[tuple[float, int, int]],
    out_tokens: int, target_ms: float, cap_ms: float,
) -> int:
    """Prompt tokens a step with `rows` decodes may carry: within cap_ms, and every stream's
    TPOT, projected with the rest of its tokens at `rows_later` rows, within the margin of the
    tightest multiple of the target (1, 2, 4) it can still meet. streams: (ms since its first
    token, tokens still to come after this step's, its least multiple: a wave's leader gave
    up the 1x)."""
    room = (cap_ms - cost.predict(0, rows)) / cost.b
    for since, left, least in streams:
        base = since + cost.predict(0, rows) + left * cost.predict(0, rows_later)
        for k in (1, 2, 4):
            span = SPLIT_MARGIN * k * target_ms * out_tokens - base
            if k >= least and span >= 0:
                room = min(room, span / cost.b)
                break
    return max(0, math.floor(room))


def sim_split(
    c: int, n_prompts: int, policy: BudgetPolicy, cost: StepCost, lin=256, lout=64,
    cap_ms: float = RIDE_CAP_MS, noise: float = 0.0, slower: float = 1.0, seed: int = 0,
) -> dict:
    """The split candidate (module docstring). The policy prices steps with `cost`; they take
    `cost` x `slower` x a lognormal(0, `noise`) draw each (a fit that is optimistic, a loaded
    machine). Where a wave cannot keep the TTFT target (waves.mode says OFF) the step budget
    decides, as in sim()."""
    rng = np.random.default_rng(seed)
    tau, ttft_ms = policy.target_tpot_ms, policy.target_ttft_ms
    assert tau is not None and ttft_ms is not None
    t, issued, done, gen = 0.0, 0, 0, 0
    waiting: list[dict] = []
    running: list[dict] = []
    ttft, itl, met = [], [], []
    led: set[int] = set()

    def refill() -> None:
        nonlocal issued
        while issued < n_prompts and len(waiting) + len(running) < c:
            waiting.append(dict(unc=lin, arr=t, out=0, held=False, stall=False, gen=gen, least=1))
            issued += 1

    def rest() -> int:
        return sum(s["unc"] for s in running if s["out"] == 0 and not s["held"]) + sum(
            s["unc"] for s in waiting
        )

    refill()
    while done < n_prompts:
        active = [s for s in running if s["out"] > 0 and not s["stall"]]
        if active and all(s.get("leads") == gen for s in active):
            for s in active:
                s["stall"] = True  # only the coming wave's leader decodes: the wave fills
            active = []
        prompts = [s for s in running if s["out"] == 0] + waiting
        work = [(s["unc"], s["arr"] - t + ttft_ms) for s in prompts]
        w = mode(False, [], work, cost, CHUNK, False)  # FILL, or OFF: the wave is late anyway
        if active and w is Wave.FILL:
            w = Wave.DEFER  # the prompts ride beside the streams (never wait for their drain)
        inflight = len(running) + len(waiting)
        if w is Wave.OFF:
            for s in running:  # no wave: held first tokens come out, leaders decode
                s["stall"] = False
                if s["held"]:
                    s["held"], s["unc"] = False, 1
            active = [s for s in running if s["out"] > 0]
            pre = [s for s in running if s["unc"] > 0 and s["out"] == 0]
            slack = tpot_slack_ms(tau, [(s["first"] / 1000, s["out"]) for s in active], t / 1000)
            cum, ps = 0, []
            for s in pre + waiting:
                cum += s["unc"]
                ps.append((cum, s["arr"] - t + ttft_ms))
            budget = prefill_budget(
                policy, cost, len(active), rest(), 0.0, Deadlines(slack, tuple(ps))
            )
        elif w is Wave.FILL:
            budget = CHUNK
        else:  # streams decode: the prompts ride
            later = [(t - s["first"], lout - s["out"] - 1, s["least"]) for s in active]
            budget = ride_tokens(cost, len(active), inflight, later, lout - 1, tau, cap_ms)
        fill = w is Wave.FILL
        ptoks, firsts = 0, []
        order = [s for s in running if s["out"] == 0 and not s["held"] and s["unc"] > 0]
        while budget > 0 and (order or waiting):
            if not order:
                order.append(waiting.pop(0))
                running.append(order[0])
            s = order[0]
            n = min(s["unc"], budget)
            s["unc"] -= n
            budget -= n
            ptoks += n
            if s["unc"] == 0:
                order.pop(0)
                if w is Wave.OFF:
                    firsts.append(s)
                elif s["gen"] not in led:  # the generation's leader: its first token at once
                    led.add(s["gen"])
                    s["leads"], s["stall"], s["least"] = s["gen"], fill, 2
                    firsts.append(s)
                else:  # held: the last token waits for the release
                    s["held"], s["unc"] = True, 1
                    ptoks -= 1
        held = [s for s in running if s["held"]]
        end = fill and not ptoks and not firsts  # the wave has nothing left but its release
        if held and (end or released(cost, inflight, rest(), lout - 1, tau)):
            for s in held:
                s["held"], s["unc"] = False, 0
                ptoks += 1
                firsts.append(s)
            for s in running:
                s["stall"] = False
            gen += 1
        if fill and not ptoks and not firsts:
            for s in running:  # nothing left to compute or release: the wave starts
                s["stall"] = False
            continue
        rows = [] if fill else active
        draw = float(rng.lognormal(0.0, noise)) if noise else 1.0
        t += cost.predict(ptoks, len(rows)) * slower * draw
        done += advance(t, rows, firsts, running, (ttft, itl, met), lout)
        refill()
    return figures(n_prompts * (lin + lout), t, ttft, itl, met)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cost", choices=sorted(COSTS), default="epyc")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="waves_sim")
    p.add_argument("--prompts", type=int, default=64, help="goodput.py's runs: 48")
    p.add_argument("--ride-cap-ms", type=float, default=RIDE_CAP_MS)
    p.add_argument("--noise", type=float, default=0.0, help="split: lognormal sigma per step")
    p.add_argument("--slower", type=float, default=1.0, help="split: steps x this vs the fit")
    p.add_argument("--seeds", type=int, default=1, help="split: median figures over seeds")
    p.add_argument("--early-margin", type=float, default=waves.EARLY_MARGIN)
    p.add_argument("--gap-share", type=float, default=waves.GAP_SHARE)
    a = p.parse_args(argv)
    # The waves rows' early first tokens read these where waves.early_firsts does.
    waves.EARLY_MARGIN, waves.GAP_SHARE = a.early_margin, a.gap_share
    cost = COSTS[a.cost]
    rows: list[dict] = []
    both = BudgetPolicy(CHUNK, 32, backlog_steps=16, target_tpot_ms=50, target_ttft_ms=4000)
    for c in (8, 32):
        cases = [
            ("defaults", BudgetPolicy(CHUNK, 32, backlog_steps=16)),
            ("--target-tpot-ms 50", BudgetPolicy(CHUNK, 32, backlog_steps=16, target_tpot_ms=50)),
            (
                "--target-tpot-ms 50 --target-ttft-ms 4000 (waves)",
                BudgetPolicy(CHUNK, 32, backlog_steps=16, target_tpot_ms=50, target_ttft_ms=4000),
            ),
        ]
        results = [(label, sim(c, a.prompts, pol, cost)) for label, pol in cases]
        runs = [
            sim_split(
                c, a.prompts, both, cost, cap_ms=a.ride_cap_ms, noise=a.noise, slower=a.slower,
                seed=seed,
            )
            for seed in range(a.seeds)
        ]
        split = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append((f"both targets, split (ride cap {a.ride_cap_ms:g} ms)", split))
        for label, r in results:
            rows.append({"concurrency": c, "policy": label, **r})
            shown = {k: round(v, 2 if k.startswith("good") else 0) for k, v in r.items()}
            print(f"C={c} {label:<50}", shown, flush=True)
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "cost_ms": {"a": cost.a, "b": cost.b, "c": cost.c},
            "split": {"noise": a.noise, "slower": a.slower, "seeds": a.seeds},
            "waves": {"early_margin": a.early_margin, "gap_share": a.gap_share},
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
