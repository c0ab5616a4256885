"""bf16 attention: the native kernels' bf16 dot-product path (vdpbf16ps) against their widening
path (bf16 widened to float32 for every product, what a host without the instructions runs),
the same build, interleaved in one process, at SmolLM-135M's attention shapes: every layer has
its own K/V cache with each row's pages scattered over it, and a step calls each layer once.

  prefill  2x256 (two fresh 256-token prompts), 512@2048 (a 512-token chunk behind 2,048 cached
           tokens)
  decode   32x300 (32 rows, 300 tokens of context each)

`--base-rev REV` adds a third side, the kernels as they were at git revision REV (built from
that revision's sources), interleaved with the other two: a change's old/new in one process.
Printed per shape: ms per step of each side (median of the alternations), each other side over
dot per alternation (median, min-max), and each side's worst error against float32 attention
over the same bf16 pages (layer 0). `--clock cpu` times the process's CPU seconds instead of the
wall's: on a loaded host it keeps other processes' time out (not a worker's spin at a barrier).

    .venv/bin/python benchmarks/bf16_attention.py --base-rev e752c9e
    .venv/bin/python benchmarks/bf16_attention.py --tiny --alternations 2  # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, kernel_at, machine, this_command, write_json  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 9, 3, 64, 16  # SmolLM-135M's attention
PREFILL = {"2x256": ([0, 0], [256, 256]), "512@2048": ([2048], [512])}
DECODE = {"32x300": (32, 300)}


def scattered(rows: int, ctx: int, layers: int, gen) -> tuple:  # noqa: ANN001
    """Per-layer bf16 K/V caches and a page table scattering each row's pages over them."""
    import torch

    pages = -(-ctx // PAGE)
    slots = (rows * pages + 1) * PAGE
    kc = [torch.randn(slots, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(layers)]
    vc = [torch.randn(slots, KV_HEADS, DIM, generator=gen).bfloat16() for _ in range(layers)]
    table = torch.randperm(slots // PAGE - 1, generator=gen)[: rows * pages].view(rows, pages) + 1
    return kc, vc, table


def prefill_case(prefixes: list[int], q_lens: list[int], layers: int, gen) -> tuple:  # noqa: ANN001
    """(call(kernel, layer), float32 reference of layer 0) for one prefill step."""
    import torch

    from kvfence.model.attn import PagedRows
    from kvfence.model.attn.reference import ReferenceBackend

    ctx = [p + m for p, m in zip(prefixes, q_lens, strict=True)]
    kc, vc, table = scattered(len(ctx), max(ctx), layers, gen)
    ql = torch.tensor(q_lens)
    rows = PagedRows(torch.cumsum(ql, 0) - ql, ql, torch.tensor(ctx), table, PAGE, 0, True)
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=gen).bfloat16()
    out = torch.empty_like(q)
    scale = DIM**-0.5

    def call(f: Callable, layer: int) -> torch.Tensor:
        f(q, kc[layer], vc[layer], table, rows.ctx_lens, rows.q_starts, rows.q_lens, PAGE, scale,
          0, out)
        return out

    ref = ReferenceBackend(torch.device("cpu"), 0, torch.float32).plan(rows).run(
        q.float(), kc[0].float(), vc[0].float(), scale, None
    )
    return call, ref


def decode_case(rows: int, ctx: int, layers: int, gen) -> tuple:  # noqa: ANN001
    import torch
    import torch.nn.functional as F

    kc, vc, table = scattered(rows, ctx, layers, gen)
    lens = torch.full((rows,), ctx, dtype=torch.int64)
    q = torch.randn(rows, HEADS, DIM, generator=gen).bfloat16()
    scale = DIM**-0.5

    def call(f: Callable, layer: int) -> torch.Tensor:
        return f(q, kc[layer], vc[layer], table, lens, PAGE, scale, 0)

    slots = (table[:, :, None] * PAGE + torch.arange(PAGE)).flatten(1)[:, :ctx]
    k, v = kc[0][slots].float().transpose(1, 2), vc[0][slots].float().transpose(1, 2)
    ref = F.scaled_dot_product_attention(
        q.float()[:, :, None], k, v, enable_gqa=True, scale=scale
    )[:, :, 0]
    return call, ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="2 layers, small shapes (smoke test)")
    p.add_argument("--alternations", type=int, default=12)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default)")
    p.add_argument("--base-rev", help="also time the kernels as they were at this git revision")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="bf16_attention")
    a = p.parse_args(argv)

    import torch

    from kvfence.model import kernels

    if a.threads:
        torch.set_num_threads(a.threads)
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    layers = 2 if a.tiny else 30
    prefill, decode = PREFILL, DECODE
    if a.tiny:
        prefill, decode = {"2x32": ([0, 0], [32, 32]), "16@64": ([64], [16])}, {"4x40": (4, 40)}
    cases: dict[str, tuple] = {}
    gen = torch.Generator().manual_seed(0)
    def sides_of(stem: str, tree: Callable) -> dict[str, Callable | None]:
        sides = {"dot": tree(), "widened": tree(widened=True)}
        return sides | ({"base": kernel_at(a.base_rev, stem)} if a.base_rev else {})

    for name, (prefixes, q_lens) in prefill.items():
        sides = sides_of("paged_prefill", kernels.paged_prefill)
        cases[f"prefill {name}"] = (sides, *prefill_case(prefixes, q_lens, layers, gen))
    for name, (rows, ctx) in decode.items():
        sides = sides_of("paged_decode", kernels.paged_decode)
        cases[f"decode {name}"] = (sides, *decode_case(rows, ctx, layers, gen))

    results = {}
    for name, (sides, call, ref) in cases.items():
        if any(f is None for f in sides.values()):
            raise SystemExit("the native kernels cannot be built here")
        error = {k: (call(f, 0).float() - ref).abs().max().item() for k, f in sides.items()}
        times: dict[str, list[float]] = {k: [] for k in sides}
        for f in sides.values():  # warm: each side's workers and scratch once through every layer
            for layer in range(layers):
                call(f, layer)
        for i in range(a.alternations):
            for k in list(sides) if i % 2 == 0 else list(sides)[::-1]:
                t = clock()
                for layer in range(layers):
                    call(sides[k], layer)
                times[k].append(clock() - t)
        row: dict[str, object] = {
            k: {"ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}
            for k, ts in times.items()
        }
        line = [f"{name} ({layers} layers):"]
        line += [f"{k} {statistics.median(ts) * 1e3:.2f} ms," for k, ts in times.items()]
        for k in sides.keys() - {"dot"}:
            r = sorted(x / d for x, d in zip(times[k], times["dot"], strict=True))
            row[f"{k}_over_dot"] = {"median": statistics.median(r), "min": r[0], "max": r[-1]}
            line.append(f"{k}/dot {statistics.median(r):.2f} ({r[0]:.2f}-{r[-1]:.2f}),")
        row["max_abs_error_vs_float32"] = error
        results[name] = row
        line.append("max error vs float32 " + ", ".join(f"{k} {e:.2e}" for k, e in error.items()))
        print(" ".join(line), flush=True)
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "clock": a.clock,
            "base_rev": a.base_rev,
            "threads": torch.get_num_threads(),
            "layers": layers,
            "shapes": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
