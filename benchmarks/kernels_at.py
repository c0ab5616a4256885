"""The engine's steps with the native kernels of a base revision against the tree's, one process,
interleaved: a 32-row decode step, a fresh prefill step and a batch-1 decode step (float32), each
side's kernels swapped into the same engine and timed in turn; the ratio per step kind with its
spread, and a check that both sides give the same greedy tokens.

--contend F runs a process beside it that spins F of every 10 ms on one core, as a benchmark's
client and the HTTP loop take a share of the cores of `vllm bench serve` runs. Where the host is
shared by others, say so next to any figure: the ratio, not the times, is what this reads.

    .venv/bin/python benchmarks/kernels_at.py --base-rev main --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    bench_model,
    machine,
    module_at,
    random_prompts,
    ratio_ci,
    submit_prompts,
    this_command,
    write_json,
)

SIDES = ("base", "new")


def spin(share: float, stop: object) -> None:
    """Busy `share` of every 10 ms until `stop` is set."""
    while not stop.is_set():  # type: ignore[attr-defined]
        t = time.perf_counter()
        while time.perf_counter() - t < 0.01 * share:
            pass
        time.sleep(0.01 * (1 - share))


class Kernels:
    """One side's packed GEMM, fused epilogue and decode attention, swapped into an engine."""

    def __init__(self, gemm: object, epilogue: object, decode: object) -> None:
        self.gemm, self.epilogue, self.decode = gemm, epilogue, decode

    def install(self, runner: object) -> None:
        from kvfence.model.kernels import FusedEpilogue

        cm = runner.model  # type: ignore[attr-defined]
        ep = FusedEpilogue(self.epilogue.add_rms_norm, self.epilogue.silu_mul,  # type: ignore[attr-defined]
                           self.epilogue.rope_store)  # type: ignore[attr-defined]
        cm.epilogue = ep
        if cm.rope_store is not None:
            cm.rope_store = ep.rope_store
        for p in cm.projections():
            if p.gemm is not None:
                p.gemm = replace(p.gemm, matmul=self.gemm.packed_matmul)  # type: ignore[attr-defined]
        runner.attention = replace(runner.attention, decode=self.decode.paged_decode)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-rev", default="main", help="the git revision of the base kernels")
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--rows", type=int, default=32, help="rows of the decode step")
    p.add_argument("--context", type=int, default=300, help="tokens behind each decode row")
    p.add_argument("--prefill", default="2x256", help="NxL: a fresh prefill step of N x L tokens")
    p.add_argument("--steps", type=int, default=6, help="decode steps timed per turn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--contend", type=float, default=0.0, help="share of a core spun beside it")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="kernels_at")
    a = p.parse_args(argv)
    import torch

    from kvfence.engine.llm import LLM
    from kvfence.engine.request import SamplingParams
    from kvfence.model import kernels

    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    pre_n, pre_len = (int(x) for x in a.prefill.split("x"))
    ctx = max(a.context, pre_len) + a.steps + 8
    llm = LLM(str(model), dtype="float32", context_length=ctx,
              kv_pool_tokens=(a.rows + pre_n) * ctx * 2,
              chunked_prefill_size=max(512, pre_n * pre_len))
    runner = llm.engine.runner
    sides = {
        "base": Kernels(*(module_at(a.base_rev, s)
                          for s in ("packed_gemm", "fused_epilogue", "paged_decode"))),
        "new": Kernels(kernels._build("packed_gemm"), kernels._build("fused_epilogue"),
                       kernels._build("paged_decode")),
    }
    vocab = runner.model.config.vocab_size
    ids, seeds = itertools.count(), itertools.count(1000)
    engine = llm.engine

    tokens = {}
    probe = random_prompts(4, 16, vocab, seed=7)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for side, k in sides.items():
        k.install(runner)
        # A tenant per side: no side reads the other's cached prompt pages.
        tokens[side] = [c.token_ids for c in llm.generate(probe, greedy, tenant=side)]
    same = tokens["base"] == tokens["new"]
    print(f"greedy tokens equal: {same}", flush=True)

    def decode(batch: int) -> Callable[[], list[float]]:
        def run() -> list[float]:
            prompts = random_prompts(batch, a.context, vocab, seed=batch)  # cached after the first
            done = submit_prompts(engine, prompts, a.steps + 2, ids)
            while any(s.num_output == 0 for s in engine._seqs.values()):
                engine.step()
            times = []
            for _ in range(a.steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            while len(done) < batch:
                engine.step()
            return times
        return run

    def prefill() -> list[float]:
        submit_prompts(engine, random_prompts(pre_n, pre_len, vocab, seed=next(seeds)), 1, ids)
        t = time.perf_counter()
        engine.step()
        times = [time.perf_counter() - t]
        while engine.has_work():
            engine.step()
        return times

    kinds = {f"decode_b{a.rows}": decode(a.rows), f"prefill_{a.prefill}": prefill,
             "decode_b1": decode(1)}
    for k in sides.values():  # warm-up, and the decode prompts into the prefix cache
        k.install(runner)
        for f in kinds.values():
            f()
    stop = mp.Event()
    rival = None
    if a.contend > 0:
        rival = mp.Process(target=spin, args=(a.contend, stop), daemon=True)
        rival.start()
    times = {k: {s: [] for s in SIDES} for k in kinds}
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for r in range(a.rounds):
            order = SIDES if r % 2 == 0 else SIDES[::-1]
            for kind, f in kinds.items():
                med = {}
                for side in order:
                    sides[side].install(runner)
                    ts = f()
                    times[kind][side] += ts
                    med[side] = statistics.median(ts)
                ratios[kind].append(med["base"] / med["new"])
            print(f"round {r + 1}: " + ", ".join(
                f"{k} base/new {v[-1]:.3f}" for k, v in ratios.items()), flush=True)
    finally:
        stop.set()
        if rival is not None:
            rival.join(timeout=5)
    result: dict[str, object] = {
        "command": cmd, "machine": machine(), "model": str(model), "base_rev": a.base_rev,
        "torch_threads": torch.get_num_threads(), "contend": a.contend,
        "greedy_tokens_equal": same, "steps": {},
    }
    print(f"load average {machine().get('loadavg', '?')}; base/new > 1: the tree's kernels faster")
    for kind in kinds:
        med = {s: statistics.median(times[kind][s]) * 1000 for s in SIDES}
        ci = ratio_ci(ratios[kind])
        result["steps"][kind] = {"median_ms": med, "base_over_new": ci,  # type: ignore[index]
                                 "per_round": ratios[kind]}
        print(f"{kind:>16}: median base {med['base']:8.2f} new {med['new']:8.2f} ms; base/new "
              f"{ci['mean']:.3f} (95% CI {ci['lo']:.3f}-{ci['hi']:.3f}; rounds "
              f"{min(ratios[kind]):.3f}-{max(ratios[kind]):.3f})")
    write_json(Path(a.out) / f"{a.name}.json", result)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
