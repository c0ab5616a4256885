"""Prefill behind a cached prefix, and a long prompt's memory (issue 44):

  rate    the FLOP rate of one 512-token chunk (the whole model: projections, MLP, attention)
          whose context holds P cached tokens before it, P in --prefixes, against a fresh
          512-token chunk (P = 0). FLOPs are counted with attention (2 x active non-embedding
          params per token, plus 4 x heads x head_dim x the keys each query sees, per layer), so
          a longer context costs more FLOPs, fairly; the ratio shows what it costs beyond them
          (a gathered copy of the context, a mask). The cached K/V are random: attention's cost
          does not depend on the values.
  memory  the peak resident memory beyond weights and the (pre-touched) KV pool of a whole
          prompt's chunked prefill, --long against --short tokens, each in a fresh process
          (VmHWM, reset through /proc/self/clear_refs once the pool is touched and free heap
          trimmed), on a model of the same widths with --memory-layers layers (a layer's working
          set is freed before the next one runs, so depth changes the weights, not the peak
          beyond them); and the bytes torch allocates in the model's forward of the last chunk
          at each size (exact, counted at torch's dispatcher), which must not grow either.

The checkpoint's positions are exceeded on purpose where the sizes ask for it (random weights:
only the cost is measured). `--backend torch` measures the reference gather path for contrast.

    .venv/bin/python benchmarks/prefill_attention.py
    .venv/bin/python benchmarks/prefill_attention.py --tiny --prefixes 256 --short 256 \\
        --long 1024 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from benchmarks.common import (  # noqa: E402
    TINY_SHAPE,
    bench_model,
    build_smol_checkpoint,
    machine,
    this_command,
    write_json,
)
from kvfence.engine.llm import LLM  # noqa: E402
from kvfence.engine.runner import ModelRunner  # noqa: E402
from kvfence.model.attention import AttentionMetadata  # noqa: E402
from kvfence.model.attn import PagedRows  # noqa: E402

CHUNK = 512


def runner_for(
    model: Path, tokens: int, backend: str, chunk: int = CHUNK, dtype: str = "float32"
) -> ModelRunner:
    llm = LLM(
        str(model),
        dtype=dtype,
        context_length=tokens,
        kv_pool_tokens=tokens + 64,
        allow_context_beyond_positions=True,
        attention_backend=backend,
        chunked_prefill_size=chunk,
        enable_prefix_caching=False,
    )
    return llm.engine.runner


def chunk_forward(runner: ModelRunner, start: int, length: int) -> None:
    """The model over tokens [start, start + length) of one row whose pages are 1, 2, ... (page
    0 is the pool's null page): what a step of that chunk runs, without the scheduler."""
    ids, meta = chunk_step(runner, start, length)
    with torch.inference_mode():
        runner.model(ids, meta, runner.kv_caches)


def chunk_step(
    runner: ModelRunner, start: int, length: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """The token ids and the planned attention metadata of chunk_forward's step."""
    ps = runner.pool.page_size
    n_pages = runner.pool.pages_for(start + length)
    table = torch.arange(1, 1 + n_pages, dtype=torch.int64)[None, :]
    positions = torch.arange(start, start + length)
    slots = table[0, positions // ps] * ps + positions % ps
    rows = PagedRows(
        q_starts=torch.zeros(1, dtype=torch.int64),
        q_lens=torch.tensor([length]),
        ctx_lens=torch.tensor([start + length]),
        page_table=table,
        page_size=ps,
        window=runner.sliding_window or 0,
        covers_step=True,
    )
    meta = AttentionMetadata(positions, slots, [runner.attention.plan(rows)])
    ids = torch.randint(2, runner.model.config.vocab_size, (length,))
    return ids, meta


class Allocations(TorchDispatchMode):
    """Every tensor torch allocates while active (an op's output whose storage none of its inputs
    holds): their bytes in total and the largest one. A gathered context or an [Lq, Lk] mask is
    such a tensor; the native kernels' scratch is not (it is sized by a job, never a context)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        held = {_storage(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and _storage(t) not in held:
                n = t.untyped_storage().nbytes()
                self.total += n
                self.largest = max(self.largest, n)
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def forward_allocations(runner: ModelRunner, start: int, length: int) -> Allocations:
    """What the model's forward of one chunk allocates (planning excluded: a row's page table
    is 8 bytes a page, once per step, not per layer)."""
    ids, meta = chunk_step(runner, start, length)
    with torch.inference_mode(), Allocations() as seen:
        runner.model(ids, meta, runner.kv_caches)
    return seen


def chunk_flops(runner: ModelRunner, prefix: int, chunk: int = CHUNK) -> float:
    mc = runner.model.config
    dense = 2 * (mc.num_active_params - mc.num_embedding_params) * chunk
    keys = chunk * prefix + chunk * (chunk + 1) // 2  # each query sees the prefix and its past
    attention = 4 * mc.num_heads * mc.head_dim * keys * mc.num_layers
    return float(dense + attention)


def rate(
    model: Path, prefixes: list[int], reps: int, backend: str, clock=time.perf_counter
) -> dict:
    runner = runner_for(model, max(prefixes) + CHUNK, backend)
    for k, v in runner.kv_caches:  # random cached K/V, finite
        k.normal_()
        v.normal_()
    out: dict = {"attention": runner.attention.name, "cases": []}
    cases = [0, *prefixes]
    for prefix in cases:
        chunk_forward(runner, prefix, CHUNK)  # warm-up
    # Interleaved, one of each case per round, so a loaded machine's drift hits every case alike.
    times: dict[int, list[float]] = {p: [] for p in cases}
    for _ in range(reps):
        for prefix in cases:
            t = clock()
            chunk_forward(runner, prefix, CHUNK)
            times[prefix].append(clock() - t)
    for prefix in cases:
        s = statistics.median(times[prefix])
        out["cases"].append(
            {"prefix": prefix, "seconds": s, "gflops": chunk_flops(runner, prefix) / s / 1e9}
        )
    fresh = out["cases"][0]["gflops"]
    for c in out["cases"]:
        c["vs_fresh"] = c["gflops"] / fresh
    return out


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_case(model: Path, tokens: int, backend: str) -> dict:
    """Run in a fresh process: peak RSS growth of one prompt's chunked prefill."""
    runner = runner_for(model, tokens, backend)
    runner.pool.k.fill_(0.0)  # touch the whole pool: its pages are counted before the reset
    runner.pool.v.fill_(0.0)
    # The baseline is taken before any chunk runs: one chunk's activations (and the first
    # call's thread stacks and arenas, the same at every size) count in both sizes' peaks.
    # Heap freed while loading is still resident and would hide the chunks' working set: give
    # it back first, so the peak counts every page a chunk touches.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = rss_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    for start in range(0, tokens, CHUNK):
        chunk_forward(runner, start, min(CHUNK, tokens - start))
    peak = (rss_kib("VmHWM") - base) / 1024
    last = forward_allocations(runner, tokens - CHUNK, CHUNK)
    return {
        "tokens": tokens,
        "peak_growth_mib": peak,
        "last_chunk_allocated_bytes": last.total,
        "last_chunk_largest_tensor_bytes": last.largest,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: SmolLM-135M's shape, random)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer stand-in (smoke runs)")
    ap.add_argument("--prefixes", type=int, nargs="+", default=[2048, 16384])
    ap.add_argument("--short", type=int, default=4096)
    ap.add_argument("--long", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true",
                    help="rate: one thread, timed by this process's CPU time (a direction on a "
                         "loaded host, where other processes' preemption would skew wall time)")
    ap.add_argument("--backend", choices=("auto", "native", "torch"), default="auto")
    ap.add_argument("--memory-layers", type=int, default=2,
                    help="layers of the memory case's model (its widths are --model's or SmolLM's)")
    ap.add_argument("--only", choices=("rate", "memory"), help="run one part")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--memory-case", type=int, help=argparse.SUPPRESS)  # the child's job
    args = ap.parse_args()
    if args.memory_case is not None:
        print(json.dumps(memory_case(Path(args.model), args.memory_case, args.backend)))
        return
    result: dict = {"command": this_command(), "machine": machine(), "chunk": CHUNK}
    if args.only != "memory":
        if args.cpu_time:
            torch.set_num_threads(1)
        clock = time.process_time if args.cpu_time else time.perf_counter
        result["rate"] = rate(bench_model(args.model, args.tiny), args.prefixes, args.reps,
                              args.backend, clock)
        result["rate"]["clock"] = "process cpu time, 1 thread" if args.cpu_time else "wall"
        print(f"attention backend: {result['rate']['attention']}")
        for c in result["rate"]["cases"]:
            print(
                f"512-token chunk behind {c['prefix']:>6} cached: {c['seconds'] * 1e3:8.1f} ms "
                f"{c['gflops']:7.1f} GFLOP/s  {c['vs_fresh']:.3f}x fresh"
            )
    if args.only != "rate":
        result["memory"] = memory(args)
    if args.out:
        write_json(args.out, result)


def memory(args: argparse.Namespace) -> dict:
    model = memory_model(args.model, args.tiny, args.memory_layers)
    mem = []
    for tokens in (args.short, args.long):
        child = [sys.executable, __file__, "--memory-case", str(tokens), "--backend",
                 args.backend, "--model", str(model)]
        done = subprocess.run(child, check=True, capture_output=True, text=True)
        mem.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"prefill of {tokens:>6} tokens: peak {mem[-1]['peak_growth_mib']:8.1f} MiB "
              f"beyond weights and pool; its last chunk's forward allocates "
              f"{mem[-1]['last_chunk_allocated_bytes'] / 2**20:.2f} MiB, largest tensor "
              f"{mem[-1]['last_chunk_largest_tensor_bytes'] / 2**20:.2f} MiB")
    out = {
        "layers": args.memory_layers,
        "cases": mem,
        "long_vs_short": mem[1]["peak_growth_mib"] / max(mem[0]["peak_growth_mib"], 1.0),
        "allocated_long_vs_short": mem[1]["last_chunk_allocated_bytes"]
        / mem[0]["last_chunk_allocated_bytes"],
    }
    print(f"peak memory, {args.long} vs {args.short} tokens: {out['long_vs_short']:.2f}x "
          f"(last chunk's allocations {out['allocated_long_vs_short']:.3f}x)")
    return out


def memory_model(model: str | None, tiny: bool, layers: int) -> Path:
    """The memory case's checkpoint: --model's own, or the bench model's widths at `layers`."""
    if model:
        return Path(model)
    shape = {**(TINY_SHAPE if tiny else {}), "num_hidden_layers": layers}
    name = f"kvfence-bench-{'tiny' if tiny else 'smol135'}-{layers}l"
    return build_smol_checkpoint(Path(tempfile.gettempdir()) / name, **shape)


if __name__ == "__main__":
    main()
