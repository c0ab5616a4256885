"""Prefill against this host's matmul roofline, float32 and bf16 (issue 44): the FLOP rate of a
fresh --tokens-token prefill chunk through the whole model (FLOPs counted with attention, as
prefill_attention.py counts them) as a percentage of the best matmul measured in the same run at
the model's own projection shapes ([tokens, in] x [in, out] for q/k/v, o, gate/up and down),
every candidate tried for each: torch's `x @ W^T` over the transposed weight (MKL for float32,
oneDNN for bf16), `F.linear` over the weight as stored, oneDNN over the weight reordered once
(what kvfence's bf16 projections run on a host without bf16 dot products) and kvfence's packed
kernel (its float32 projections', and its bf16 ones' where the host has bf16 dot products).

Rounds are interleaved (each round runs every prefill and every matmul once, medians over
--reps), so a loaded machine's drift hits both sides of each percentage alike; the absolute
figures on a shared host are not the machine's, the percentages are what to read.

    .venv/bin/python benchmarks/roofline.py                    # SmolLM-135M's shape, random
    .venv/bin/python benchmarks/roofline.py --tiny --tokens 64 --reps 1   # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import bench_model, machine, this_command, write_json  # noqa: E402
from benchmarks.prefill_attention import chunk_flops, chunk_forward, runner_for  # noqa: E402
from kvfence.model import kernels  # noqa: E402
from kvfence.model.config import ModelConfig  # noqa: E402
from kvfence.model.linear import Projection  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shapes(mc: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a dense layer, fused as the model runs them."""
    h, d = mc.hidden_size, mc.head_dim
    return {
        "qkv": (h, (mc.num_heads + 2 * mc.num_kv_heads) * d),
        "o": (mc.num_heads * d, h),
        "gate_up": (h, 2 * mc.intermediate_size),
        "down": (mc.intermediate_size, h),
    }


def candidates(k: int, n: int, dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor], object]]:
    w = torch.randn(n, k).to(dtype)  # [out, in], as a checkpoint stores it
    w_t = w.t().contiguous()
    out: dict[str, Callable[[torch.Tensor], object]] = {
        "x @ W^T": lambda x: x @ w_t,
        "F.linear": lambda x: F.linear(x, w),
    }
    if torch.backends.mkldnn.is_available():  # what bf16 projections run (prepack_onednn)
        prepacked = torch.ops.mkldnn._reorder_linear_weight(w, None)
        out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none",
                                                                     [], "")
    gemm = kernels.packed_gemm_bf16() if dtype == torch.bfloat16 else kernels.packed_gemm()
    if gemm is not None:
        packed = Projection(w_t.clone())
        packed.pack(gemm)
        out["packed"] = lambda x: packed(x)
    return out


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint dir (default: SmolLM-135M's shape, random)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer stand-in (smoke runs)")
    ap.add_argument("--tokens", type=int, default=512, help="the prefill chunk (a fresh prompt)")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=list(DTYPES))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    model = bench_model(args.model, args.tiny)
    runners = {dt: runner_for(model, args.tokens, "auto", args.tokens, dt) for dt in args.dtypes}
    mc = next(iter(runners.values())).model.config
    mm = {
        (dt, name, cand): (fn, torch.randn(args.tokens, k).to(DTYPES[dt]), 2 * args.tokens * k * n)
        for dt in args.dtypes
        for name, (k, n) in shapes(mc).items()
        for cand, fn in candidates(k, n, DTYPES[dt]).items()
    }
    flops = chunk_flops(next(iter(runners.values())), 0, args.tokens)
    prefill: dict[str, list[float]] = {dt: [] for dt in args.dtypes}
    mm_times: dict[tuple[str, str, str], list[float]] = {key: [] for key in mm}
    with torch.inference_mode():
        for rep in range(args.reps + 1):  # round 0 warms every path up and is dropped
            for dt, runner in runners.items():
                s = timed(lambda r=runner: chunk_forward(r, 0, args.tokens))
                if rep:
                    prefill[dt].append(s)
            for key, (fn, x, _) in mm.items():
                s = timed(lambda fn=fn, x=x: fn(x))
                if rep:
                    mm_times[key].append(s)
    result: dict = {"command": this_command(), "machine": machine(), "tokens": args.tokens}
    for dt in args.dtypes:
        rates = {
            key: mm[key][2] / statistics.median(t) / 1e9
            for key, t in mm_times.items()
            if key[0] == dt
        }
        for (_, name, cand), r in sorted(rates.items()):
            print(f"{dt:>8} {name:>7} {cand:>8}: {r:7.1f} GFLOP/s")
        best_key = max(rates, key=rates.__getitem__)
        best = rates[best_key]
        s = statistics.median(prefill[dt])
        rate = flops / s / 1e9
        print(f"{dt:>8} prefill of {args.tokens} tokens: {args.tokens / s:8.1f} tok/s "
              f"{rate:7.1f} GFLOP/s = {100 * rate / best:5.1f}% of the best matmul "
              f"({best:.1f} GFLOP/s, {best_key[1]} via {best_key[2]})")
        result[dt] = {
            "prefill_tokens_per_s": args.tokens / s,
            "prefill_gflops": rate,
            "best_matmul_gflops": best,
            "best_matmul": list(best_key[1:]),
            "percent_of_roofline": 100 * rate / best,
            "matmul_gflops": {f"{k[1]} {k[2]}": v for k, v in rates.items()},
        }
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
