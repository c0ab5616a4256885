"""kvfence's native bf16 packed GEMM (kvfence/model/kernels/packed_gemm.cpp on the host's bf16
dot products) against oneDNN over weights reordered once (`mkldnn._linear_pointwise`, what bf16
projections ran before, and vLLM's CPU route here), at SmolLM-135M's projection shapes and the
LM head, per row count: decode's 1-64 rows and prefill's 256-2048.

One process, A/B alternated per repetition, so a loaded host's drift hits both alike; each
repetition's ratio is native time / oneDNN time, reported as the median and range. Decode rows
run every layer's own copy of a shape (cold weights, streamed from memory as in a real step);
prefill rows run --prefill-copies copies (compute-bound). The ratio of the two sides' fastest
repetitions is printed too: on a loaded host a descheduled OpenMP worker stalls a call for a
timeslice, and the fastest runs are the ones it spared. Correctness is tests/, not here.

    .venv/bin/python benchmarks/bf16_gemm.py                     # ~5 min on an idle EPYC
    .venv/bin/python benchmarks/bf16_gemm.py --tiny --reps 2      # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import RESULTS, SMOL_SHAPE, machine, this_command, write_json  # noqa: E402
from kvfence.model import kernels  # noqa: E402
from kvfence.model.linear import to_panels  # noqa: E402

DECODE_ROWS = "1,2,4,8,16,32,64"
PREFILL_ROWS = "256,512,2048"


def shapes(s: dict, tiny: bool) -> dict[str, tuple[int, int]]:
    """(in, out) of each fused projection and of the LM head."""
    h, inter = s["hidden_size"], s["intermediate_size"]
    kvd = h // s["num_attention_heads"] * s["num_key_value_heads"]
    return {
        "qkv": (h, h + 2 * kvd),
        "o": (h, h),
        "gate_up": (h, 2 * inter),
        "down": (inter, h),
        "head": (h, s["vocab_size"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="2 small layers (smoke test)")
    p.add_argument("--rows", default=DECODE_ROWS)
    p.add_argument("--prefill-rows", default=PREFILL_ROWS)
    p.add_argument("--prefill-copies", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--shapes", default="qkv,o,gate_up,down,head")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="bf16_gemm")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); on a loaded "
                   "host 1 keeps a descheduled OpenMP worker from stalling every call's barrier")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    gemm = kernels.packed_gemm_bf16()
    if gemm is None:  # bf16 projections run oneDNN here: nothing to compare
        why = "no native bf16 packed GEMM here (no bf16 dot products, or no compiler)"
        print(why)
        write_json(Path(a.out) / f"{a.name}.json",
                   {"command": this_command(), "machine": machine(), "skipped": why})
        return 0
    s = dict(SMOL_SHAPE)
    if a.tiny:
        s.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=500)
    layers = s["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    table: dict[str, dict[str, dict[str, float]]] = {}
    decode = [int(r) for r in a.rows.split(",") if r]
    prefill = [int(r) for r in a.prefill_rows.split(",") if r]
    with torch.inference_mode():
        for name, (k, n) in shapes(s, a.tiny).items():
            if name not in a.shapes.split(","):
                continue
            copies = 1 if name == "head" else layers
            ws = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for _ in range(copies)]
            native = [to_panels(w.t().contiguous(), gemm.width) for w in ws]
            onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
            table[name] = {}
            # the head runs only the rows that sample (and prompt logprobs' blocks of 256)
            row_counts = decode + [m for m in prefill if name != "head" or m <= 256]
            for m in row_counts:
                c = copies if m in decode else min(copies, a.prefill_copies)
                xs = [torch.randn(m, k, generator=g).bfloat16() for _ in range(c)]

                def run_native(xs=xs, ws=native[:c], n=n) -> None:
                    for x, panels in zip(xs, ws, strict=True):
                        gemm.matmul(x, panels, n)

                def run_onednn(xs=xs, ws=onednn[:c]) -> None:
                    for x, w in zip(xs, ws, strict=True):
                        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

                run_native()
                run_onednn()  # warm-up: first-call setup, page faults
                tn, to, ratios = [], [], []
                for rep in range(a.reps):
                    order = (run_native, run_onednn) if rep % 2 == 0 else (run_onednn, run_native)
                    t = {}
                    for f in order:
                        t0 = time.perf_counter()
                        f()
                        t[f] = time.perf_counter() - t0
                    tn.append(t[run_native] * 1000)
                    to.append(t[run_onednn] * 1000)
                    ratios.append(t[run_native] / t[run_onednn])
                flop = 2 * m * k * n * c
                row = {
                    "native_ms": statistics.median(tn),
                    "onednn_ms": statistics.median(to),
                    "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                    "ratio_of_minima": min(tn) / min(to),
                    "native_gflops": flop / statistics.median(tn) / 1e6,
                    "onednn_gflops": flop / statistics.median(to) / 1e6,
                }
                table[name][str(m)] = row
                print(f"{name:>7} {m:5d} rows x{c:<2d}: native {row['native_ms']:8.2f} ms "
                      f"oneDNN {row['onednn_ms']:8.2f} ms  native/oneDNN {row['ratio']:.2f} "
                      f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}, of minima "
                      f"{row['ratio_of_minima']:.2f})  "
                      f"{row['native_gflops']:6.1f} / {row['onednn_gflops']:6.1f} GFLOP/s",
                      flush=True)
    result = {
        "command": this_command(),
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "shapes": {k: list(v) for k, v in shapes(s, a.tiny).items()},
        "native_over_onednn": table,
    }
    write_json(Path(a.out) / f"{a.name}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
