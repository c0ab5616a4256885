"""bfloat16 against float32 inside kvfence, one process, interleaved: engine step times (batch-1
decode, an N-row decode step, a prefill step) and the bf16/fp32 ratio of each; with --profile,
the same steps under torch.profiler, time per op (the native kernels named as ops), the two
sides next to each other, so what bf16 loses is seen op by op.

--sides picks the two engines (A, then B; ratios are B / A): float32, bfloat16 (projections as
this host runs them: the native packed GEMM where it has bf16 dot products) or bfloat16-onednn
(oneDNN's matmuls over weights reordered once, what bf16 ran before the native GEMM):

    .venv/bin/python benchmarks/bf16_step.py --sides bfloat16-onednn,bfloat16 --profile
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    bench_model,
    machine,
    random_prompts,
    submit_prompts,
    this_command,
    write_json,
)

SIDES = ("float32", "bfloat16", "bfloat16-onednn")
CPU: list = []  # [ProfilerActivity.CPU], set once torch is imported


def labelled(name: str, fn: Callable) -> Callable:
    """fn under a profiler label: pybind kernels are not torch ops, the profiler would miss them."""
    import torch

    def call(*args: object) -> object:
        with torch.profiler.record_function(name):
            return fn(*args)

    return call


def label_kernels(llm: object) -> None:
    """Every native kernel the engine calls, wrapped so the profiler names it."""
    from dataclasses import replace

    runner = llm.engine.runner  # type: ignore[attr-defined]
    cm = runner.model
    if cm.epilogue is not None:
        ep = cm.epilogue
        cm.epilogue = replace(
            ep,
            add_rms_norm=labelled("kv::add_rms_norm", ep.add_rms_norm),
            silu_mul=labelled("kv::silu_mul", ep.silu_mul),
            rope_store=labelled("kv::rope_store", ep.rope_store),
        )
    if cm.rope_store is not None:
        cm.rope_store = cm.epilogue.rope_store
    att = runner.attention
    if hasattr(att, "decode"):
        runner.attention = replace(
            att,
            decode=labelled("kv::paged_decode", att.decode),
            prefill=labelled("kv::paged_prefill", att.prefill),
        )
    for p in cm.projections():
        if p.gemm is not None:
            p.gemm = replace(p.gemm, matmul=labelled("kv::packed_gemm", p.gemm.matmul))


class Probe:
    """Profiles only the timed steps of a run (none without a profiler)."""

    def __init__(self, prof: object | None = None) -> None:
        self.prof, self.steps = prof, 0
        self.started = False

    def begin(self) -> None:
        if self.prof is not None and not self.started:
            self.prof.start()  # type: ignore[attr-defined]
            self.started = True
        elif self.prof is not None:
            self.prof.toggle_collection_dynamic(True, CPU)  # type: ignore[attr-defined]

    def end(self, steps: int) -> None:
        self.steps += steps
        if self.prof is not None:
            self.prof.toggle_collection_dynamic(False, CPU)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.prof is not None and self.started:
            self.prof.stop()  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--batches", default="1,32", help="decode step sizes")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per run")
    p.add_argument("--prefill", default="2x256", help="NxL: a prefill step of N x L tokens")
    p.add_argument("--alternations", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="per-op times under torch.profiler")
    p.add_argument("--top", type=int, default=25, help="ops printed per step kind")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="bf16_step")
    p.add_argument("--sides", default="float32,bfloat16", help=f"A,B of {', '.join(SIDES)}")
    a = p.parse_args(argv)
    sides = tuple(a.sides.split(","))
    if len(sides) != 2 or not set(sides) <= set(SIDES) or sides[0] == sides[1]:
        p.error(f"--sides: two different ones of {', '.join(SIDES)}")
    import torch

    from kvfence.engine.llm import LLM
    from kvfence.model import kernels

    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    pre_n, pre_len = (int(x) for x in a.prefill.split("x"))
    batches = [int(b) for b in a.batches.split(",")]
    ctx = max(a.prompt_len, pre_len) + a.steps + 8
    pool = max(batches) * ctx * 2

    def engine(side: str) -> LLM:
        onednn = side.endswith("-onednn")
        llm = LLM(str(model), dtype=side.removesuffix("-onednn"), context_length=ctx,
                  kv_pool_tokens=pool, chunked_prefill_size=max(512, pre_n * pre_len),
                  linear_backend="torch" if onednn else "auto")
        if onednn:  # the plain weights reordered for oneDNN; the native epilogues as before
            runner = llm.engine.runner
            runner.model.prepack_onednn()
            ep = kernels.fused_epilogue()
            if ep is not None:
                runner.model.use_epilogue(ep, runner.pool.k.dtype)
        return llm

    llms = {d: engine(d) for d in sides}
    if a.profile:
        for llm in llms.values():
            label_kernels(llm)
    vocab = llms[sides[0]].engine.runner.model.config.vocab_size
    ids = itertools.count()
    # Every prefill round's prompts are new: a repeat would be a prefix-cache hit that computes
    # only the last page, not the step this measures.
    seeds = itertools.count(1000)

    def decode_steps(engine: object, batch: int, probe: Probe) -> list[float]:
        """Step times while `batch` sequences of prompt_len decode (not the prefill)."""
        prompts = random_prompts(batch, a.prompt_len, vocab, seed=batch)
        done = submit_prompts(engine, prompts, a.steps + 2, ids)
        engine.step()  # the prefill
        times = []
        probe.begin()
        for _ in range(a.steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        probe.end(len(times))
        while len(done) < batch:
            engine.step()
        return times

    def prefill_steps(engine: object, rounds: int, probe: Probe) -> list[float]:
        times = []
        for _ in range(rounds):
            submit_prompts(engine, random_prompts(pre_n, pre_len, vocab, seed=next(seeds)), 1, ids)
            probe.begin()
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            probe.end(1)
            while engine.has_work():
                engine.step()
        return times

    kinds: dict[str, Callable[[object, Probe], list[float]]] = {
        f"decode_b{b}": (lambda e, s, b=b: decode_steps(e, b, s)) for b in batches
    }
    kinds[f"prefill_{a.prefill}"] = lambda e, s: prefill_steps(e, 2, s)
    for llm in llms.values():  # warm-up: first calls, oneDNN's primitive caches
        for f in kinds.values():
            f(llm.engine, Probe())
    times: dict[str, dict[str, list[float]]] = {k: {d: [] for d in sides} for k in kinds}
    for _ in range(a.alternations):
        for kind, f in kinds.items():
            for d in sides:
                times[kind][d] += f(llms[d].engine, Probe())
    result: dict[str, object] = {"command": cmd, "machine": machine(), "model": str(model),
                                 "torch_threads": torch.get_num_threads(), "steps": {},
                                 "sides": list(sides)}
    print(f"load average {machine().get('loadavg', '?')}")
    for kind in kinds:
        # The minimum too: on a loaded host it is the step least disturbed by the others.
        med = {d: statistics.median(times[kind][d]) * 1000 for d in sides}
        low = {d: min(times[kind][d]) * 1000 for d in sides}
        sa, sb = sides
        ratio = med[sb] / med[sa]
        result["steps"][kind] = {  # type: ignore[index]
            "median_ms": med, "min_ms": low, "b_over_a": ratio, "b_over_a_min": low[sb] / low[sa],
        }
        print(f"{kind:>16}: median {sa} {med[sa]:8.2f} {sb} {med[sb]:8.2f} ms "
              f"({ratio:.2f}x); min {sa} {low[sa]:8.2f} {sb} {low[sb]:8.2f} ms "
              f"({low[sb] / low[sa]:.2f}x)")
    if a.profile:
        result["ops"] = {kind: profile_ops(llms, f, a.top) for kind, f in kinds.items()}
    write_json(Path(a.out) / f"{a.name}.json", result)
    return 0


def profile_ops(llms: dict, run: Callable, top: int) -> dict[str, dict[str, float]]:
    """ms per step of each top-level op, the two sides side by side, printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    CPU[:] = [ProfilerActivity.CPU]
    per_op: dict[str, dict[str, float]] = defaultdict(dict)
    for d in llms:
        probe = Probe(profile(activities=[ProfilerActivity.CPU]))
        wall = sum(run(llms[d].engine, probe))
        probe.close()
        n = max(1, probe.steps)
        for ev in probe.prof.key_averages():
            per_op[ev.key][d] = ev.self_cpu_time_total / 1000 / n
        per_op["(step wall)"][d] = wall * 1000 / n
    rows = sorted(per_op.items(), key=lambda kv: -max(kv[1].values()))[:top]
    print(f"{'op (ms)':<44} " + " ".join(f"{d[:16]:>16}" for d in llms))
    for name, v in rows:
        print(f"{name[:44]:<44} " + " ".join(f"{v.get(d, 0):16.3f}" for d in llms))
    return dict(per_op)


if __name__ == "__main__":
    sys.exit(main())
