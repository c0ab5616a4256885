"""Tensor parallelism on CPU: TP=2 x 1 thread against TP=1 x 2 threads on the same cores, in the
same run (rounds alternate A/B so drift hits both): batch throughput (output tokens/s) and batch-1
decode time per token (ITL), the share of a batch-1 decode step rank 0 spends in collectives
(its all-reduces and the logits gather; it includes waiting for the slower rank), and the gloo
all-reduce's cost against its bytes (a separate 2-process group, nothing else running).

The model is SmolLM-135M's shape with 8 query heads and 4 KV heads (9 heads do not split over
2 ranks); random weights, built locally. No number here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    TINY_SHAPE,
    build_smol_checkpoint,
    log_command,
    machine,
    random_prompts,
    this_command,
    write_json,
)

SPLITTABLE = {"num_attention_heads": 8, "num_key_value_heads": 4}


def model_dir(model: str | None, tiny: bool) -> Path:
    if model:
        return Path(model)
    name = "kvfence-bench-tp-tiny" if tiny else "kvfence-bench-smol135-tp"
    shape = {**TINY_SHAPE, **SPLITTABLE} if tiny else dict(SPLITTABLE)
    return build_smol_checkpoint(Path(tempfile.gettempdir()) / name, **shape)


def measure(model: Path, tp: int, threads: int, a: argparse.Namespace) -> dict[str, float]:
    """One engine: batch throughput, then batch-1 ITL and rank 0's collective time."""
    from kvfence.engine.llm import LLM
    from kvfence.engine.request import SamplingParams

    ctx = a.input_len + a.output_len + 16
    llm = LLM(
        str(model),
        tp_size=tp,
        threads=threads,
        context_length=ctx,
        kv_pool_tokens=(a.batch + 1) * ctx,
        enable_prefix_caching=False,
    )
    try:
        vocab = llm.engine.model_config.vocab_size
        prompts = random_prompts(a.batch, a.input_len, vocab, seed=5)
        params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        t = time.perf_counter()
        llm.generate(prompts, params)
        tput = a.batch * a.output_len / (time.perf_counter() - t)

        one = prompts[:1]

        def timed(m: int) -> float:
            t0 = time.perf_counter()
            llm.generate(one, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - t0

        group = llm.engine.tp.group if llm.engine.tp is not None else None
        t1 = timed(1)
        comm0 = group.comm_s if group is not None else 0.0
        tn = timed(a.output_len + 1)
        comm = (group.comm_s - comm0) if group is not None else 0.0
        return {
            "throughput_tok_s": tput,
            "itl_ms": (tn - t1) / a.output_len * 1000,
            "comm_share_batch1": comm / tn if group is not None else 0.0,
        }
    finally:
        llm.engine.shutdown()


def allreduce_rank(rank: int, store: str, sizes: list[int], repeats: int) -> None:
    """One rank of the all-reduce microbenchmark; rank 0 prints `bytes seconds` per size."""
    import torch
    import torch.distributed as dist

    from kvfence.model.tp import RankGroup

    torch.set_num_threads(1)
    group = RankGroup(dist.FileStore(store, 2), rank, 2, torch.device("cpu"), 60.0)
    for n in sizes:
        x = torch.ones(n // 4, dtype=torch.float32)
        group.all_reduce_(x)
        group.barrier()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            group.all_reduce_(x)
            best = min(best, time.perf_counter() - t)
        if rank == 0:
            print(f"{n} {best}", flush=True)


def allreduce_curve(sizes: list[int], repeats: int) -> list[dict[str, float]]:
    store = str(Path(tempfile.mkdtemp(prefix="kvfence-tp-bench-")) / "store")
    argv = [sys.executable, __file__, "--allreduce-rank", "{r}", "--store", store]
    argv += ["--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats)]
    log_command([a.replace("{r}", "0|1") for a in argv])
    procs = [
        subprocess.Popen(
            [a.replace("{r}", str(r)) for a in argv], stdout=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    out, _ = procs[0].communicate(timeout=600)
    procs[1].wait(timeout=60)
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return [{"bytes": int(b), "us": float(s) * 1e6} for b, s in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: SmolLM-135M's shape, 8/4 heads")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="cores for each configuration")
    p.add_argument("--sizes", default="2304,18432,147456,1179648", help="all-reduce bytes")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="tp")
    p.add_argument("--allreduce-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.allreduce_rank is not None:
        allreduce_rank(a.allreduce_rank, a.store, sizes, a.repeats)
        return 0
    cmd = this_command()
    model = model_dir(a.model, a.tiny)
    configs = {f"tp1x{a.threads}": (1, a.threads), f"tp2x{a.threads // 2}": (2, a.threads)}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    for _ in range(a.rounds):
        for name, (tp, threads) in configs.items():
            runs[name].append(measure(model, tp, threads, a))
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    curve = allreduce_curve(sizes, a.repeats)
    for name, s in summary.items():
        print(
            f"{name}: {s['throughput_tok_s']:.1f} tok/s batch {a.batch}, batch-1 ITL "
            f"{s['itl_ms']:.2f} ms, collectives {100 * s['comm_share_batch1']:.0f}% of batch-1"
        )
    for row in curve:
        print(f"all-reduce {row['bytes']} B: {row['us']:.0f} us")
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": cmd,
            "machine": machine(),
            "model": str(model),
            "batch": a.batch,
            "input_len": a.input_len,
            "output_len": a.output_len,
            "runs": runs,
            "summary": summary,
            "allreduce": curve,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
