"""Projection matmuls of one decode step, all layers + LM head, on cold weights: torch's
`x @ W^T` (MKL; kvfence's torch path), `F.linear` (what transformers runs), oneDNN packed weights
(`mkldnn._linear_pointwise`, the route vLLM's CPU backend takes) and kvfence's packed kernel
(kvfence/model/kernels/packed_gemm.cpp), per row count, interleaved in one process. Every layer
has its own weights, so each step streams them from memory as a real decode step does; the
floor is their bytes over the read bandwidth measured here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    SMOL_SHAPE,
    machine,
    new_figure,
    plot_available,
    save_figure,
    this_command,
    write_json,
)
from benchmarks.decode_floor import read_bandwidth  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="2 small layers (smoke test)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="linear_kernels")
    a = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from kvfence.model import kernels
    from kvfence.model.linear import to_panels

    gemm = kernels.packed_gemm()
    if gemm is None:
        print("the packed kernel did not build here; nothing to compare", file=sys.stderr)
        return 1
    s = dict(SMOL_SHAPE)
    if a.tiny:
        s.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=500)
    h, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kvd = h // s["num_attention_heads"] * s["num_key_value_heads"]
    # [out, in] of qkv, o, gate_up, down; then the LM head
    shapes = [(h + 2 * kvd, h), (h, h), (2 * inter, h), (h, inter)]
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=g) * 0.02 for _ in range(layers) for o, i in shapes]
    weights.append(torch.randn(s["vocab_size"], h, generator=g) * 0.02)
    weight_bytes = sum(w.numel() * 4 for w in weights)
    plain = [w.t().contiguous() for w in weights]
    packed = [(to_panels(w_t, gemm.width), w_t.shape[1]) for w_t in plain]
    onednn = None
    try:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in weights]
    except Exception as e:  # a torch without oneDNN: leave that column out
        print(f"oneDNN packed weights unavailable ({e})")

    def inputs(m: int) -> list[torch.Tensor]:
        return [torch.randn(m, w.shape[1]) for w in weights]

    def run_mkl(xs: list[torch.Tensor]) -> None:
        for x, w_t in zip(xs, plain, strict=True):
            x @ w_t

    def run_linear(xs: list[torch.Tensor]) -> None:
        for x, w in zip(xs, weights, strict=True):
            F.linear(x, w)

    def run_packed(xs: list[torch.Tensor]) -> None:
        for x, (panels, n) in zip(xs, packed, strict=True):
            gemm.matmul(x, panels, n)

    def run_onednn(xs: list[torch.Tensor]) -> None:
        for x, w in zip(xs, onednn or [], strict=True):
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    methods = {"torch x @ W^T (MKL)": run_mkl, "F.linear": run_linear}
    if onednn is not None:
        methods["oneDNN packed (vLLM)"] = run_onednn
    methods["kvfence packed"] = run_packed
    rows = [int(r) for r in a.rows.split(",")]
    ms: dict[str, dict[int, float]] = {k: {} for k in methods}
    for m in rows:
        xs = inputs(m)
        times: dict[str, list[float]] = {k: [] for k in methods}
        for f in methods.values():
            f(xs)  # warm-up (first-call setup, page faults)
        for _ in range(a.repeats):  # interleaved, so drift hits every method alike
            for k, f in methods.items():
                t = time.perf_counter()
                f(xs)
                times[k].append(time.perf_counter() - t)
        for k, v in times.items():
            ms[k][m] = sorted(v)[len(v) // 2] * 1000
        print(f"rows {m:4d}: " + ", ".join(f"{k} {ms[k][m]:.2f} ms" for k in methods), flush=True)
    bw = max(read_bandwidth(max(weight_bytes, 64 << 20), 3) for _ in range(3))
    floor_ms = weight_bytes / bw * 1000
    base = "torch x @ W^T (MKL)"
    result = {
        "command": this_command(),
        "machine": machine(),
        "torch_threads": torch.get_num_threads(),
        "shape": {k: s[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers")}
        | {"vocab_size": s["vocab_size"]},
        "weight_bytes": weight_bytes,
        "floor_ms": floor_ms,
        "median_ms": {k: {str(m): v for m, v in d.items()} for k, d in ms.items()},
        "packed_over_mkl": {str(m): ms["kvfence packed"][m] / ms[base][m] for m in rows},
    }
    print(f"floor (weights / read bandwidth): {floor_ms:.2f} ms; kvfence packed / MKL: "
          + ", ".join(f"{m}: {r:.2f}" for m, r in result["packed_over_mkl"].items()))
    out = Path(a.out)
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        fig, ax = new_figure(figsize=(6, 4))
        for k, d in ms.items():
            ax.plot(rows, [d[m] for m in rows], marker="o", label=k)
        ax.axhline(floor_ms, color="C7", ls="--", lw=0.8, label="bandwidth floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (decode batch size)")
        ax.set_ylabel("ms per step, all projections + LM head")
        ax.set_title(f"{weight_bytes / 1e6:.0f} MB of float32 weights, cold")
        ax.legend(fontsize=8)
        save_figure(fig, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
