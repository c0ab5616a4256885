"""Decode attention kernel (kvfence/model/kernels/paged_decode.cpp) against its source at another
git revision, interleaved in one process: every layer has its own K/V cache and each row's pages
are scattered over it, as in a real pool, so each call streams its rows' K/V from memory. Both
builds must give the same output to the bit; the figure is ms per step (all layers) and the GB/s
of K/V read, beside the read bandwidth `torch.sum` gets here. A change that moves rounding on
purpose (`--rounding`) is compared by its error against a float64 reference instead: void when
the tree's worst error is over twice the base's (and over 1e-6 of the output's scale).

    .venv/bin/python benchmarks/decode_attention.py --base-rev 36ff464
    .venv/bin/python benchmarks/decode_attention.py --base-rev HEAD --tree-runs 16

`--tree-runs N` gives the tree's side the same K/V with each row's pages laid out in runs of N
neighbours (as the pool's lowest-first allocation hands them out) instead of scattered one by
one (as a FIFO free list leaves them after churn): with the same source on both sides, the
figure is what page locality alone is worth.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, kernel_at, machine, this_command, write_json  # noqa: E402
from benchmarks.decode_floor import read_bandwidth  # noqa: E402


def step(f, q, kc, vc, table, lens, page) -> float:  # noqa: ANN001
    """Seconds for one decode step's attention: every layer once."""
    t = time.perf_counter()
    for k, v in zip(kc, vc, strict=True):
        f(q, k, v, table, lens, page, 0.125, 0)
    return time.perf_counter() - t


def reference(q, k, v, table, lens, page) -> object:  # noqa: ANN001
    """The attention in float64 from the same pages, for the error of each build."""
    import torch

    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = (table[b].unsqueeze(1) * page + torch.arange(page)).flatten()[:n]
        kb = k[slots].double().repeat_interleave(group, 1)
        vb = v[slots].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[b].double(), kb) * 0.125
        out[b] = torch.einsum("ht,thd->hd", s.softmax(-1), vb)
    return out


def in_runs(kc, vc, table, run, num_pages, page, gen) -> tuple:  # noqa: ANN001
    """The same K/V per row, its pages moved to runs of `run` neighbouring pages."""
    import torch

    rows, pages = table.shape
    starts = torch.randperm(num_pages // run, generator=gen)[: -(-rows * pages // run)]
    moved = (starts[:, None] * run + torch.arange(run)).flatten()[: rows * pages].view(rows, pages)
    src = (table.flatten()[:, None] * page + torch.arange(page)).flatten()
    dst = (moved.flatten()[:, None] * page + torch.arange(page)).flatten()
    kc2, vc2 = [k.clone() for k in kc], [v.clone() for v in vc]
    for k2, v2, k, v in zip(kc2, vc2, kc, vc, strict=True):
        k2[dst] = k[src]
        v2[dst] = v[src]
    return kc2, vc2, moved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-rev", required=True, help="the git revision to compare against")
    p.add_argument("--tiny", action="store_true", help="2 layers, small shapes (smoke test)")
    p.add_argument("--shapes", default="32x320,8x1216,1x2048", help="ROWSxCONTEXT,...")
    p.add_argument("--alternations", type=int, default=12)
    p.add_argument("--tree-runs", type=int, default=0, help="tree's pages in runs of N (0: same)")
    p.add_argument(
        "--rounding",
        action="store_true",
        help="the change moves rounding: check both against float64, not each other",
    )
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="decode_attention")
    a = p.parse_args(argv)

    import torch

    from kvfence.model import kernels

    torch.set_num_threads(torch.get_num_threads())
    new = kernels.paged_decode()
    if new is None:
        raise SystemExit("the native decode kernel cannot be built here")
    sides = {"base": kernel_at(a.base_rev, "paged_decode"), "tree": new}
    heads, kv_heads, dim, page = 9, 3, 64, 16  # SmolLM-135M's attention
    layers, slots = (2, 2048) if a.tiny else (30, 23_000)
    shapes = ["2x64"] if a.tiny else a.shapes.split(",")
    results = {}
    for shape in shapes:
        rows, ctx = (int(x) for x in shape.split("x"))
        pages = -(-ctx // page)
        gen = torch.Generator().manual_seed(0)
        kc = [torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(layers)]
        vc = [torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(layers)]
        table = torch.randperm(slots // page, generator=gen)[: rows * pages].view(rows, pages)
        q = torch.randn(rows, heads, dim, generator=gen)
        lens = torch.full((rows,), ctx, dtype=torch.int64)
        data = {"base": (kc, vc, table), "tree": (kc, vc, table)}
        if a.tree_runs:
            data["tree"] = in_runs(kc, vc, table, a.tree_runs, slots // page, page, gen)
        outs = {
            k: f(q, data[k][0][0], data[k][1][0], data[k][2], lens, page, 0.125, 0)
            for k, f in sides.items()
        }
        equal = torch.equal(outs["base"], outs["tree"])
        ref = reference(q, kc[0], vc[0], table, lens, page)
        error = {
            k: ((o.double() - ref).abs().max() / ref.abs().max()).item() for k, o in outs.items()
        }

        times: dict[str, list[float]] = {k: [] for k in sides}
        for k, f in sides.items():
            step(f, q, *data[k], lens, page)  # warm
        for i in range(a.alternations):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            for k in order:
                times[k].append(step(sides[k], q, *data[k], lens, page))
        kv_bytes = layers * rows * ctx * kv_heads * dim * 4 * 2
        row = {"bitwise_equal": equal, "max_error_vs_float64": error}
        for k, ts in times.items():
            med = statistics.median(ts)
            row[k] = {
                "ms": med * 1e3,
                "min_ms": min(ts) * 1e3,
                "max_ms": max(ts) * 1e3,
                "gb_s": kv_bytes / med / 1e9,
            }
        ratios = sorted(t / b for t, b in zip(times["tree"], times["base"], strict=True))
        row["tree_over_base"] = {
            "median": statistics.median(ratios),
            "min": ratios[0],
            "max": ratios[-1],
        }
        results[shape] = row
        print(
            f"{shape}: base {row['base']['ms']:.1f} ms ({row['base']['gb_s']:.1f} GB/s), "
            f"tree {row['tree']['ms']:.1f} ms ({row['tree']['gb_s']:.1f} GB/s), tree/base "
            f"{row['tree_over_base']['median']:.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}), "
            f"bitwise equal: {equal}, error vs float64 base {error['base']:.2e} tree "
            f"{error['tree']:.2e}",
            flush=True,
        )
        if not equal and not a.rounding:
            raise SystemExit(f"{shape}: the two builds disagree; the comparison is void")
        if error["tree"] > max(2 * error["base"], 1e-6):
            raise SystemExit(f"{shape}: the tree's error is over twice the base's; void")
    bandwidth = read_bandwidth(256 << 20 if not a.tiny else 16 << 20, 3)
    print(f"read bandwidth (torch.sum): {bandwidth / 1e9:.1f} GB/s")
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "base_rev": a.base_rev,
            "tree_runs": a.tree_runs,
            "layers": layers,
            "read_bandwidth_gb_s": bandwidth / 1e9,
            "shapes": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
