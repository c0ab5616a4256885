"""Goodput over HTTP with vLLM's own client: kvfence serve, kvfence up 1P1D and vLLM at its
defaults, in one run.

Every side is driven by `vllm bench serve` (random dataset, EOS ignored, per-request records
saved), in passes whose side order rotates, so drift and warm-up favour none. Goodput (DistServe,
and `vllm bench serve --goodput`) is requests per second that meet both a TTFT and a TPOT target;
it is computed here from each run's per-request records over the whole SLO grid (TTFT x TPOT), so
no single SLO choice decides it. TPOT of a request is (latency - TTFT) / (output tokens - 1), as
vLLM's client computes it.

How each peer runs, and why:
- vLLM: `vllm serve` at its defaults (compiled graphs, not --enforce-eager; its scheduler and
  chunked prefill as shipped), with what its CPU build needs to run here at all: the dtype of the
  comparison, --max-model-len of the checkpoint, VLLM_CPU_OMP_THREADS_BIND=0-1 (all cores),
  VLLM_CPU_KVCACHE_SPACE (enough for the workload), loopback. Its prefix caching is left at
  vLLM's default (no flag either way; runs recorded before this read --no-enable-prefix-caching
  in "servers"): the random workload's prompts share no prefix, and each run's are fresh.
- kvfence serve and kvfence up (1 prefill + 1 decode, the cores split by `up`): their defaults,
  plus --kvfence-args when given (the latency targets an operator would set:
  `--kvfence-args "--target-tpot-ms 50 --target-ttft-ms 1000"`), recorded in the JSON.
- serve_alt (only when asked for in --sides): kvfence serve with --alt-args added to its flags,
  run in the same passes as the others, for an A/B of a setting against the same vLLM runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    Server,
    bench_model,
    kvfence_server,
    log_command,
    machine,
    shape_ctx,
    this_command,
    vllm_server,
    write_json,
)

TTFT_S = (1.0, 2.0, 4.0)
TPOT_MS = (50.0, 100.0, 200.0)
SIDES = ("serve", "up", "vllm")
# `serve` again with --alt-args added: an A/B of a serve setting in the same passes.
ALT = "serve_alt"
SERVED = "bench"


def client_command(
    vllm_python: str, url: str, model: Path, a: argparse.Namespace, c: int, seed: int, out: Path
) -> list[str]:
    return [
        str(Path(vllm_python).with_name("vllm")),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        url,
        "--model",
        SERVED,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(c),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
    ]


def per_request(result: dict) -> list[tuple[float, float]]:
    """(ttft s, tpot s) of every request that completed; a failed one counts as never good."""
    out = []
    for ttft, itl, n, err in zip(
        result["ttfts"], result["itls"], result["output_lens"], result["errors"], strict=True
    ):
        if err or not n:
            out.append((float("inf"), float("inf")))
            continue
        latency = ttft + sum(itl)
        out.append((ttft, (latency - ttft) / (n - 1) if n > 1 else 0.0))
    return out


def goodput_grid(result: dict) -> dict[str, float]:
    reqs = per_request(result)
    grid = {}
    for t, p in itertools.product(TTFT_S, TPOT_MS):
        good = sum(ttft <= t and tpot <= p / 1e3 for ttft, tpot in reqs)
        grid[f"ttft{t:g}s_tpot{p:g}ms"] = good / result["duration"]
    return grid


def summarise(result: dict) -> dict[str, float]:
    return {
        "throughput": result["total_token_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "failed": result["num_prompts"] - result["completed"],
        **{f"goodput_{k}": v for k, v in goodput_grid(result).items()},
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--sides", default=",".join(SIDES), help=f"some of serve,up,vllm,{ALT}")
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument(
        "--vllm-python",
        default="/work/vllm-venv/bin/python",
        help="benchmarks/setup_vllm.sh makes it; its `vllm` is the client for all",
    )
    p.add_argument("--kv-pool-tokens", type=int, default=65536)
    p.add_argument("--kvfence-args", default="", help="more flags for both kvfence sides")
    p.add_argument("--alt-args", default="", help=f"flags {ALT} adds to serve's (an A/B)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="goodput")
    a = p.parse_args(argv)
    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    ctx = shape_ctx(model)
    sides = [s for s in a.sides.split(",") if s]
    work = Path(tempfile.mkdtemp(prefix="kvfence-goodput-"))
    extra = ["--dtype", a.dtype, "--served-model-name", SERVED, *shlex.split(a.kvfence_args)]
    servers: dict[str, Server] = {}
    runs: list[dict] = []
    try:
        # One at a time, each ready before the next starts: a boot measures the host (kvfence's
        # warm-up fits its step cost, vLLM compiles and profiles), and a peer booting beside it
        # would skew what it measured.
        for side in sides:
            log = work / f"{side}.log"
            if side == "vllm":
                servers[side] = vllm_server(
                    a.vllm_python, model, ctx, log, dtype=a.dtype, prefix_caching=None,
                    extra=["--served-model-name", SERVED],
                )  # fmt: skip
            else:
                mode, more = ("serve", shlex.split(a.alt_args)) if side == ALT else (side, [])
                servers[side] = kvfence_server(
                    mode, model, ctx, a.kv_pool_tokens, log, extra=[*extra, *more]
                )
            servers[side].wait_ready()
        for pas in range(a.passes):
            for ci, c in enumerate(a.concurrency):
                # Fresh prompts per run, the same for every side of it: a run that re-sent an
                # earlier run's prompts (one seed per pass, as before) found them in kvfence's
                # prefix cache (vLLM's was off), so C=32 came after C=8 half computed.
                seed = pas * len(a.concurrency) + ci
                order = sides[pas % len(sides) :] + sides[: pas % len(sides)]
                for side in order:
                    out = work / f"{side}-c{c}-p{pas}.json"
                    argv_ = client_command(a.vllm_python, servers[side].url, model, a, c, seed, out)
                    log_command(argv_)
                    subprocess.run(argv_, check=True, stdout=subprocess.DEVNULL)
                    result = json.loads(out.read_text())
                    row = summarise(result)
                    # The records the grid is computed from, kept so it can be recomputed.
                    reqs = [[round(t, 4), round(p, 5)] for t, p in per_request(result)]
                    runs.append(
                        {"side": side, "concurrency": c, "pass": pas, **row, "requests": reqs}
                    )
                    print(
                        f"[goodput] pass {pas + 1}/{a.passes} C={c} {side}: "
                        f"{row['throughput']:.0f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                        f"ITL p99 {row['itl_p99_ms']:.0f} ms, goodput(2s,100ms) "
                        f"{row['goodput_ttft2s_tpot100ms']:.2f} req/s",
                        flush=True,
                    )
    finally:
        for srv in servers.values():
            srv.stop()
    summary = summarise_runs(runs, sides, a.concurrency)
    print_summary(summary)
    write_json(
        Path(a.out) / f"{a.name}.json",
        {
            "command": cmd,
            "machine": machine(),
            "model": str(model),
            "servers": {s: srv.command for s, srv in servers.items()},
            "kvfence_args": a.kvfence_args,
            "workload": {
                "input_len": a.input_len,
                "output_len": a.output_len,
                "num_prompts": a.num_prompts,
                "dtype": a.dtype,
            },
            "slo_grid": {"ttft_s": TTFT_S, "tpot_ms": TPOT_MS},
            "runs": runs,
            "summary": summary,
        },
    )
    return 0


def summarise_runs(runs: list[dict], sides: list[str], concurrency: list[int]) -> dict:
    """Per concurrency: each side's median and range over passes, and each kvfence side's ratio
    to vLLM paired pass by pass (ratios of time-like metrics: kvfence over vLLM, lower is
    better; of rates: kvfence over vLLM, higher is better)."""
    skip = ("side", "concurrency", "pass", "requests")
    metrics = [k for k in runs[0] if k not in skip] if runs else []
    out: dict = {}
    for c in concurrency:
        by_side = {s: [r for r in runs if r["side"] == s and r["concurrency"] == c] for s in sides}
        cell: dict = {
            s: {m: spread([r[m] for r in rs]) for m in metrics} for s, rs in by_side.items() if rs
        }
        for s in ("serve", "up", ALT):
            if s in by_side and "vllm" in by_side:
                cell[f"{s}_over_vllm"] = paired(by_side[s], by_side["vllm"], metrics)
        if "serve" in by_side and "up" in by_side:
            k = "goodput_ttft2s_tpot100ms"
            cell["up_over_serve"] = {k: paired(by_side["up"], by_side["serve"], [k])[k]}
        if "serve" in by_side and ALT in by_side:
            cell[f"{ALT}_over_serve"] = paired(by_side[ALT], by_side["serve"], metrics)
        out[f"c{c}"] = cell
    return out


def paired(xs: list[dict], ys: list[dict], metrics: list[str]) -> dict:
    """Each metric's x / y, pass by pass (0 over 0 is inf: no figure to compare)."""
    return {
        m: spread([x[m] / y[m] if y[m] else float("inf") for x, y in zip(xs, ys, strict=True)])
        for m in metrics
        if m != "failed"
    }


def print_summary(summary: dict) -> None:
    for c, cell in summary.items():
        for key in ("serve_over_vllm", "up_over_vllm", "up_over_serve", f"{ALT}_over_vllm",
                    f"{ALT}_over_serve"):
            if key not in cell:
                continue
            print(f"{c} {key}:")
            for m, s in cell[key].items():
                print(f"  {m:32s} {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})")


if __name__ == "__main__":
    sys.exit(main())
