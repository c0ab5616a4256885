"""The native epilogue kernels (kernels/fused_epilogue.cpp) on vs off inside the engine,
interleaved in one process: engine decode steps at each batch size (median step time), with
--prefill a prefill step of N prompts x L tokens, and with --throughput the offline workload of
vs_engines.py (total tokens/s). "off" is the same engine with the kernel unset, i.e. torch's ops:
--kernel epilogue toggles residual add + RMSNorm and silu * up; --kernel rope_store toggles only
rope + the K/V cache write (the rest of the epilogue stays on).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    bench_model,
    machine,
    random_prompts,
    ratio_ci,
    submit_prompts,
    this_command,
    write_json,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per run")
    p.add_argument("--alternations", type=int, default=8)
    p.add_argument("--kernel", choices=("epilogue", "rope_store"), default="epilogue")
    p.add_argument("--prefill", default="", help="NxL: also time a prefill step of N x L tokens")
    p.add_argument("--prefill-rounds", type=int, default=3, help="prefill steps timed per run")
    p.add_argument("--throughput", action="store_true", help="also 32 x 256 -> 64 offline")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default=None, help="default: fused_epilogue or fused_rope_store")
    a = p.parse_args(argv)
    import torch

    from kvfence.engine.llm import LLM
    from kvfence.engine.request import SamplingParams

    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    pre_n, pre_len = (int(x) for x in a.prefill.split("x")) if a.prefill else (0, 0)
    ctx = max(a.prompt_len + a.steps + 8, a.input_len + a.output_len + 8, pre_len + 8)
    batches = [int(b) for b in a.batches.split(",")]
    pool = max(max(batches) * ctx, a.num_prompts * (a.input_len + a.output_len)) * 2
    llm = LLM(str(model), context_length=ctx, kv_pool_tokens=pool,
              chunked_prefill_size=max(512, pre_n * pre_len))
    engine = llm.engine
    cm = engine.runner.model
    kernel = getattr(cm, a.kernel)
    if kernel is None:
        print(f"the native {a.kernel} is not active (no kernel, not float32 CPU, or a q/k norm)",
              file=sys.stderr)
        return 1
    vocab = cm.config.vocab_size
    ids = itertools.count()

    def decode_step_ms(batch: int) -> float:
        """Median time of an engine step while `batch` sequences decode (the prefill step and
        the last, which frees them, are not counted)."""
        prompts = random_prompts(batch, a.prompt_len, vocab, seed=batch)
        done = submit_prompts(engine, prompts, a.steps + 2, ids)
        times = []
        while len(done) < batch:
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:-1]) * 1000

    def prefill_step_ms() -> float:
        """Median time of the step that prefills pre_n fresh prompts of pre_len tokens."""
        times = []
        for r in range(a.prefill_rounds):
            submit_prompts(engine, random_prompts(pre_n, pre_len, vocab, seed=1000 + r), 1, ids)
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
            while engine.has_work():
                engine.step()
        return statistics.median(times) * 1000

    def throughput() -> float:
        prompts = random_prompts(a.num_prompts, a.input_len, vocab, seed=0)
        sp = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, sp)
        return a.num_prompts * (a.input_len + a.output_len) / (time.perf_counter() - t)

    tasks = {f"batch{b}_step_ms": (lambda b=b: decode_step_ms(b)) for b in batches}
    if a.prefill:
        tasks[f"prefill_{a.prefill}_step_ms"] = prefill_step_ms
    if a.throughput:
        tasks["total_tokens_per_s"] = throughput
    for f in tasks.values():
        f()  # warm-up (kernel builds, first-call setup) with the kernel on
    runs: dict[str, dict[str, list[float]]] = {k: {"on": [], "off": []} for k in tasks}
    for i in range(a.alternations):  # the order flips each round, so drift hits both alike
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            setattr(cm, a.kernel, kernel if mode == "on" else None)
            for k, f in tasks.items():
                runs[k][mode].append(f())
        print(f"round {i + 1}: " + ", ".join(
            f"{k} on {v['on'][-1]:.2f} off {v['off'][-1]:.2f}" for k, v in runs.items()
        ), flush=True)
    setattr(cm, a.kernel, kernel)
    summary = {}
    for k, v in runs.items():
        on, off = statistics.median(v["on"]), statistics.median(v["off"])
        per_round = [x / y for x, y in zip(v["on"], v["off"], strict=True)]
        summary[k] = {"median_on": on, "median_off": off, "on_over_off": on / off,
                      "per_round_on_over_off": per_round, "ratio_ci": ratio_ci(per_round)}
        print(f"{k}: off {off:.2f}, on {on:.2f}, on/off {on / off:.3f} "
              f"({a.alternations} alternations)")
    write_json(Path(a.out) / f"{a.name or 'fused_' + a.kernel}.json", {
        "command": cmd,
        "machine": machine(),
        "model": str(model),
        "kernel": a.kernel,
        "torch_threads": torch.get_num_threads(),
        "alternations": a.alternations,
        "runs": runs,
        "summary": summary,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
