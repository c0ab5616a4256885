"""kvfence vs vLLM (CPU build) vs Hugging Face transformers on this CPU, on one random-init
checkpoint of SmolLM-135M's shape: offline (each engine's `LLM` / `generate`) and online (HTTP,
`kvfence bench serve` at fixed concurrency). Engines run one at a time, interleaved by round, each
in its own process; vLLM runs from its own venv (--vllm-python) and is skipped, with the reason
recorded, when that interpreter is missing or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import (  # noqa: E402
    RESULTS,
    VLLM_ENV,
    Server,
    bench_model,
    free_port,
    kvfence_bin,
    log_command,
    machine,
    new_figure,
    plot_available,
    random_prompts,
    run_bench,
    save_figure,
    this_command,
    vllm_server,
    write_json,
)

# ---- workers: run in a child process, print one JSON line -------------------------------------


def worker(
    engine: str, model: str, n: int, lin: int, lout: int, seed: int, ctx: int,
    dtype: str = "float32",
) -> dict:
    prompts = random_prompts(
        n, lin, vocab=int(json.load(open(f"{model}/config.json"))["vocab_size"]), seed=seed
    )
    short = [prompts[0][:8]]
    if engine == "kvfence":
        from kvfence.engine.llm import LLM
        from kvfence.engine.request import SamplingParams

        llm = LLM(model, context_length=ctx, kv_pool_tokens=max(n * (lin + lout) * 2, ctx),
                  dtype=dtype)

        def gen(ps: list[list[int]], m: int) -> list[list[int]]:
            sp = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
            return [c.token_ids for c in llm.generate(ps, sp)]
    elif engine == "hf":
        import torch
        import transformers as tf

        hf = tf.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

        def gen(ps: list[list[int]], m: int) -> list[list[int]]:
            ids = torch.tensor(ps)  # equal lengths: no padding
            with torch.inference_mode():
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=m,
                    min_new_tokens=m,
                    do_sample=False,
                    pad_token_id=0,
                )
            return out[:, ids.shape[1] :].tolist()
    elif engine == "vllm":
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VSP

        v = VLLM(
            model=model,
            dtype=dtype,  # compiled, as its users run it (no enforce_eager)
            enable_prefix_caching=False,
            max_model_len=ctx,
            seed=0,
        )

        def gen(ps: list[list[int]], m: int) -> list[list[int]]:
            sp = VSP(temperature=0.0, max_tokens=m, ignore_eos=True)
            outs = v.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
    else:
        raise ValueError(engine)
    gen(short, 2)  # warm-up
    t = time.perf_counter()
    outs = gen(prompts, lout)
    wall = time.perf_counter() - t

    def timed(m: int) -> float:
        t = time.perf_counter()
        gen(prompts[:1], m)
        return time.perf_counter() - t

    # Batch-1 decode: one prompt to 1 token and to lout tokens; the difference is lout-1 steps.
    t1 = min(timed(1) for _ in range(2))
    tn = min(timed(lout) for _ in range(2))
    return {
        "engine": engine,
        "wall_s": wall,
        "total_tokens_per_s": n * (lin + lout) / wall,
        "output_tokens_per_s": n * lout / wall,
        "batch1_ms_per_token": (tn - t1) / max(lout - 1, 1) * 1000,
        "outputs": outs,
    }


# ---- the parent -------------------------------------------------------------------------------


def worker_argv(python: str, engine: str, a: argparse.Namespace, model: Path) -> list[str]:
    """The command of one offline worker (a.num_prompts, a.input_len, a.output_len and, when
    the namespace has it, a.context_length)."""
    argv = [
        python,
        str(Path(__file__).resolve()),
        "--worker",
        engine,
        "--model",
        str(model),
        "--num-prompts",
        str(a.num_prompts),
        "--input-len",
        str(a.input_len),
        "--output-len",
        str(a.output_len),
    ]
    if getattr(a, "context_length", None) is not None:
        argv += ["--context-length", str(a.context_length)]
    if getattr(a, "dtype", "float32") != "float32":
        argv += ["--dtype", a.dtype]
    return argv


def run_worker(python: str, engine: str, a: argparse.Namespace, model: Path) -> dict:
    argv = worker_argv(python, engine, a, model)
    env = VLLM_ENV if engine == "vllm" else {}
    cmd = log_command(argv, env)
    p = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=a.worker_timeout
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {
            "engine": engine,
            "error": f"exit {p.returncode}: {p.stderr[-1500:]}",
            "command": cmd,
        }
    return {**json.loads(lines[-1]), "command": cmd}


def online(engine: str, a: argparse.Namespace, model: Path, out: Path) -> dict:
    port = free_port()
    if engine.startswith("kvfence"):
        argv = [
            kvfence_bin(),
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--context-length",
            str(a.context_length),
            "--kv-pool-tokens",
            str(max(a.num_prompts * (a.input_len + a.output_len) * 2, a.context_length)),
            "--log-level",
            "warning",
            "--dtype",
            a.dtype,
        ]
        if engine == "kvfence-itl":  # the latency setting: small prefill beside decodes
            argv += ["--decode-step-prefill-budget", str(a.itl_budget)]
        if engine == "kvfence-c2048":  # vLLM's CPU server default step budget (2048 tokens)
            argv += ["--chunked-prefill-size", "2048"]
        srv = Server(argv, port, log=out / f"vs_engines-{engine}-server.log")
    else:
        srv = vllm_server(
            a.vllm_python,
            model,
            a.context_length,
            out / f"vs_engines-{engine}-server.log",
            dtype=a.dtype,
            extra=["--served-model-name", "bench"],
        )
    res: dict = {"server_command": srv.command, "runs": {}}
    try:
        srv.wait_ready(timeout=600)
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        for i, c in enumerate(a.concurrency):
            # Fresh prompts per run: a repeat would hit kvfence's prefix cache, not vLLM's (off).
            r = run_bench(srv.url, a.num_prompts, a.input_len, a.output_len, c, vocab, seed=1 + i)
            res["runs"][str(c)] = {
                k: r[k]
                for k in (
                    "total_token_throughput",
                    "output_throughput",
                    "ttft_ms",
                    "itl_ms",
                    "tpot_ms",
                    "e2e_latency_ms",
                    "completed",
                    "failed",
                    "ignore_eos",
                    "prompt_format",
                )
            }
    except Exception as e:  # noqa: BLE001 - recorded, the other engines still run
        res["error"] = f"{type(e).__name__}: {e}"[-1500:]
    finally:
        srv.stop()
    return res


def plot(result: dict, path: Path) -> None:
    fig, axes = new_figure(1, 2, figsize=(11, 4))
    off = result["offline_mean"]
    names = [e for e in ("kvfence", "vllm", "hf") if e in off]
    axes[0].bar(names, [off[e]["total_tokens_per_s"] for e in names], color=["C0", "C1", "C2"])
    axes[0].set_ylabel("total tokens/s (offline)")
    axes[0].set_title(f"{result['workload']}")
    on = result["online"]
    conc = [str(c) for c in result["concurrency"]]
    engines = ("kvfence", "kvfence-c2048", "kvfence-itl", "vllm")
    shown = [e for e in engines if on.get(e, {}).get("runs")]
    width = 0.8 / max(len(shown), 1)
    for j, e in enumerate(shown):
        vals = [on[e]["runs"].get(c, {}).get("total_token_throughput", 0) for c in conc]
        axes[1].bar([i + j * width for i in range(len(conc))], vals, width, label=e)
    axes[1].set_xticks(
        [i + width * (len(shown) - 1) / 2 for i in range(len(conc))], [f"C={c}" for c in conc]
    )
    axes[1].set_ylabel("total tokens/s (HTTP)")
    if on:
        axes[1].legend()
    else:
        axes[1].set_title("online: not run")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help="default: build the SmolLM-135M-shaped one")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="every engine's weights and KV cache")
    p.add_argument("--rounds", type=int, default=2, help="offline runs per engine, interleaved")
    p.add_argument("--engines", default="kvfence,vllm,hf")
    p.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8, 32],
        help="online; empty to skip",
    )
    p.add_argument(
        "--online-engines",
        default="kvfence,kvfence-c2048,kvfence-itl,vllm",
        help="kvfence-itl: kvfence with --decode-step-prefill-budget ITL_BUDGET; kvfence-c2048: "
        "with --chunked-prefill-size 2048 (vLLM's CPU server default budget)",
    )
    p.add_argument("--itl-budget", type=int, default=64)
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--worker-timeout", type=float, default=1800)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="vs_engines")
    a = p.parse_args(argv)
    if a.worker:
        res = worker(
            a.worker, a.model, a.num_prompts, a.input_len, a.output_len, 0, a.context_length,
            a.dtype,
        )
        print(json.dumps(res))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    engines = a.engines.split(",")
    pythons = {"kvfence": sys.executable, "hf": sys.executable, "vllm": a.vllm_python}
    skipped: dict[str, str] = {}
    if "vllm" in engines and not Path(a.vllm_python).exists():
        skipped["vllm"] = f"{a.vllm_python} not found (make it with benchmarks/setup_vllm.sh)"
        engines.remove("vllm")
    rounds: list[dict] = []
    for r in range(a.rounds):
        order = engines if r % 2 == 0 else engines[::-1]
        rounds.append({e: run_worker(pythons[e], e, a, model) for e in order})
        for e in order:
            res = rounds[-1][e]
            print(
                f"round {r + 1} {e}: "
                + (
                    res.get("error")
                    or f"{res['total_tokens_per_s']:.1f} tok/s, batch-1 "
                    f"{res['batch1_ms_per_token']:.1f} ms/token"
                ),
                flush=True,
            )
    mean: dict[str, dict] = {}
    for e in engines:
        ok = [rd[e] for rd in rounds if "error" not in rd[e]]
        if not ok:
            skipped[e] = rounds[-1][e]["error"]
            continue
        mean[e] = {
            k: sum(x[k] for x in ok) / len(ok)
            for k in ("total_tokens_per_s", "output_tokens_per_s", "batch1_ms_per_token")
        }
    ratios: dict[str, object] = {}
    for other in ("vllm", "hf"):
        if "kvfence" in mean and other in mean:
            ratios[f"kvfence/{other}_throughput"] = (
                mean["kvfence"]["total_tokens_per_s"] / mean[other]["total_tokens_per_s"]
            )
            ratios[f"kvfence/{other}_batch1_ms_per_token"] = (
                mean["kvfence"]["batch1_ms_per_token"] / mean[other]["batch1_ms_per_token"]
            )
            per_round = [
                rd["kvfence"]["total_tokens_per_s"] / rd[other]["total_tokens_per_s"]
                for rd in rounds
                if "error" not in rd["kvfence"] and "error" not in rd.get(other, {"error": 1})
            ]
            ratios[f"kvfence/{other}_throughput_per_round"] = per_round
    # Token-exactness of kvfence against transformers on this very workload.
    last = rounds[-1]
    if "outputs" in last.get("kvfence", {}) and "outputs" in last.get("hf", {}):
        same = sum(
            x == y for x, y in zip(last["kvfence"]["outputs"], last["hf"]["outputs"], strict=True)
        )
        ratios["kvfence_equals_hf_sequences"] = f"{same}/{len(last['hf']['outputs'])}"
    if "outputs" in last.get("kvfence", {}) and "outputs" in last.get("vllm", {}):
        same = sum(
            x == y for x, y in zip(last["kvfence"]["outputs"], last["vllm"]["outputs"], strict=True)
        )
        ratios["kvfence_equals_vllm_sequences"] = f"{same}/{len(last['vllm']['outputs'])}"
    for rd in rounds:
        for res in rd.values():
            res.pop("outputs", None)
    onl: dict[str, dict] = {}
    if a.concurrency:
        for e in a.online_engines.split(","):
            if e in skipped or (e == "vllm" and "vllm" not in engines):
                continue
            onl[e] = online(e, a, model, out)
            if "error" in onl[e]:
                print(f"online {e}: {onl[e]['error']}")
        for mine in ("kvfence", "kvfence-c2048", "kvfence-itl"):
            if mine not in onl or "vllm" not in onl:
                continue
            for c in a.concurrency:
                k, v = onl[mine]["runs"].get(str(c)), onl["vllm"]["runs"].get(str(c))
                if k and v:
                    ratios[f"online_C{c}_{mine}/vllm_throughput"] = (
                        k["total_token_throughput"] / v["total_token_throughput"]
                    )
                    itl = k["itl_ms"]["p99"] / v["itl_ms"]["p99"]
                    ratios[f"online_C{c}_{mine}/vllm_itl_p99"] = itl
    result = {
        "command": cmd,
        "machine": machine(),
        "model": str(model),
        "workload": f"{a.num_prompts} x {a.input_len} -> {a.output_len}, greedy, EOS ignored",
        "dtype": a.dtype,
        "concurrency": a.concurrency,
        "rounds": rounds,
        "offline_mean": mean,
        "online": onl,
        "ratios": ratios,
        "skipped": skipped,
    }
    print(json.dumps({"offline_mean": mean, "ratios": ratios, "skipped": skipped}, indent=1))
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        plot(result, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
