"""kvfence vs vLLM (CPU build, --enable-lora) on a mixed batch of LoRA adapters (issue 46): N
prompts of L random tokens, M greedy tokens each, prompt i under adapter i mod A, float32, on one
SmolLM-135M-shaped checkpoint. The A adapters are random rank-r PEFT checkpoints on every attention
and MLP projection, written here (benchmarks/lora_mixed.py). Each engine runs offline in a worker
process of its own (vLLM from its venv), both up for the whole run; rounds interleave them, the
one going first alternating, with fresh prompts each round (prefix caching off on both sides).
Prints each round's output tokens/s (total tokens/s, as vs_engines.py reports, is in the JSON) and
the medians and ranges over the rounds; the JSON also counts the prompts whose greedy tokens the
two engines agree on (a check that both applied the same adapters, not asserted).

vLLM runs at its defaults otherwise: no --enforce-eager, though its CPU platform itself turns
compilation off (CompilationMode.NONE) whenever LoRA is enabled (vllm/platforms/cpu.py, 0.32).
Its settings beyond the defaults, and why:
  enable_lora        LoRA is off by default.
  max_loras=A        its default (1) runs one adapter per step, so no batch would be mixed.
  max_lora_rank=r    its default (16) pads every LoRA matmul to rank 16; kvfence's slots hold
                     rank r (--max-lora-rank r): the same rank on both sides.
  dtype=float32, enable_prefix_caching=False, max_model_len=L+M+16: as kvfence runs.

    .venv/bin/python benchmarks/lora_vs_vllm.py                 # 32 x 256 -> 64, 4 adapters
    .venv/bin/python benchmarks/lora_vs_vllm.py --tiny --prompts 4 --prompt-len 16 \\
        --max-tokens 4 --rounds 1                               # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import (  # noqa: E402
    RESULTS,
    VLLM_ENV,
    add_lora_workload_args,
    bench_model,
    log_command,
    machine,
    random_prompts,
    this_command,
    write_json,
)

VLLM_PYTHON = "/work/vllm-venv/bin/python"


# ---- workers: load once, then one JSON line per round read on stdin ---------------------------


def kvfence_worker(a: argparse.Namespace) -> None:
    out = answers()
    from benchmarks.lora_mixed import bench_llm, run

    mods = [f"lora{i}={p}" for i, p in enumerate(a.adapter_dirs)]
    llm = bench_llm(Path(a.model), a.prompts, a.prompt_len, a.max_tokens, mods, a.rank)
    reg = llm.engine.lora.registry
    adapters = [reg.resolve(f"lora{i}", "bench") for i in range(len(mods))]

    def gen(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        tokens: list[list[int]] = []
        tps = run(llm, prompts, adapters, max_tokens, tokens)
        return tps, tokens

    serve_rounds(gen, a, out)


def vllm_worker(a: argparse.Namespace) -> None:
    out = answers()
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=a.model, dtype="float32", enable_prefix_caching=False, seed=0,
              max_model_len=a.prompt_len + a.max_tokens + 16, enable_lora=True,
              max_loras=len(a.adapter_dirs), max_lora_rank=a.rank)
    loras = [LoRARequest(f"lora{i}", i + 1, p) for i, p in enumerate(a.adapter_dirs)]

    def gen(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                            lora_request=[loras[i % len(loras)] for i in range(len(prompts))])
        wall = time.perf_counter() - t0
        return len(prompts) * max_tokens / wall, [list(o.outputs[0].token_ids) for o in outs]

    serve_rounds(gen, a, out)


def answers() -> IO[str]:
    """The worker's answer stream: the real stdout, while whatever the engine's libraries print
    (vLLM logs to stdout) goes to stderr, the worker's log."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def serve_rounds(gen, a: argparse.Namespace, out: IO[str]) -> None:  # type: ignore[no-untyped-def]
    vocab = int(json.loads((Path(a.model) / "config.json").read_text())["vocab_size"])
    gen(random_prompts(2, a.prompt_len, vocab, seed=10_000), 2)  # warm-up, every adapter loaded
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        seed = json.loads(line)["seed"]
        tps, tokens = gen(random_prompts(a.prompts, a.prompt_len, vocab, seed), a.max_tokens)
        # Total tokens/s (prompt + output over the wall time), as vs_engines.py reports offline.
        total = tps * (a.prompt_len + a.max_tokens) / a.max_tokens
        print(json.dumps({"output_tokens_per_s": tps, "total_tokens_per_s": total,
                          "wall_s": a.prompts * a.max_tokens / tps, "tokens": tokens}),
              file=out, flush=True)


# ---- the parent -------------------------------------------------------------------------------


class Worker:
    def __init__(self, engine: str, python: str, a: argparse.Namespace, dirs: list[str],
                 log: Path) -> None:
        argv = [python, str(Path(__file__).resolve()), "--worker", engine, "--model", str(a.model),
                "--prompts", str(a.prompts), "--prompt-len", str(a.prompt_len),
                "--max-tokens", str(a.max_tokens), "--rank", str(a.rank),
                "--adapter-dirs", *dirs]
        env = VLLM_ENV if engine == "vllm" else {}
        self.engine, self.command = engine, log_command(argv, env)
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     start_new_session=True)
        self.log = log

    def read(self, timeout: float) -> dict:
        out: IO[str] = self.proc.stdout  # type: ignore[assignment]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], min(5.0, timeout))
            if ready:
                line = out.readline()
                if not line:
                    break
                if line.startswith("{"):
                    return json.loads(line)
            elif self.proc.poll() is not None:
                break
        self._log.flush()
        raise RuntimeError(f"{self.engine} worker gave no answer (exit {self.proc.poll()}): "
                           f"{self.log.read_text()[-3000:]}")

    def round(self, seed: int, timeout: float) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the worker's loop ends
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=10)
        self._log.close()


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_lora_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engines", default="kvfence,vllm", help="comma-separated; smoke: kvfence")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per load or round")
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory of lora_vs_vllm.json")
    ap.add_argument("--worker", choices=("kvfence", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--adapter-dirs", nargs="*", default=[], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        (kvfence_worker if a.worker == "kvfence" else vllm_worker)(a)
        return
    from benchmarks.lora_mixed import write_adapters
    from kvfence.model.config import ModelConfig

    a.model = bench_model(a.model, a.tiny)
    dirs = [m.split("=", 1)[1] for m in
            write_adapters(ModelConfig.from_dir(a.model), a.adapters, a.rank)]
    engines = a.engines.split(",")
    a.out.mkdir(parents=True, exist_ok=True)
    workers = {e: Worker(e, a.vllm_python if e == "vllm" else sys.executable, a, dirs,
                         a.out / f"lora_vs_vllm-{e}.log") for e in engines}
    rounds: list[dict] = []
    try:
        for w in workers.values():
            w.read(a.timeout)  # loaded, compiled, warmed up
        for k in range(a.rounds):
            order = engines if k % 2 == 0 else engines[::-1]
            res = {e: workers[e].round(k, a.timeout) for e in order}
            row: dict = {e: res[e]["output_tokens_per_s"] for e in engines}
            row["wall_s"] = {e: res[e]["wall_s"] for e in engines}
            row["total_tokens_per_s"] = {e: res[e]["total_tokens_per_s"] for e in engines}
            if len(engines) == 2:
                first, second = (res[e]["tokens"] for e in engines)
                row["same_tokens"] = sum(x == y for x, y in zip(first, second, strict=True))
            rounds.append(row)
            print(f"round {k + 1}/{a.rounds}: " + ", ".join(
                f"{e} {row[e]:.1f} out tok/s" for e in engines), flush=True)
    finally:
        for w in workers.values():
            w.stop()
    summary = {e: spread([r[e] for r in rounds]) for e in engines}
    if {"kvfence", "vllm"} <= set(engines):
        summary["kvfence/vllm"] = spread([r["kvfence"] / r["vllm"] for r in rounds])
    for name, s in summary.items():
        print(f"{name}: median {s['median']:.3f} (range {s['min']:.3f}-{s['max']:.3f})")
    write_json(a.out / "lora_vs_vllm.json", {
        "command": this_command(), "machine": machine(), "model": str(a.model),
        "workers": {e: w.command for e, w in workers.items()},
        "workload": {k: getattr(a, k) for k in ("prompts", "prompt_len", "max_tokens",
                                                 "adapters", "rank", "rounds")},
        "rounds": rounds, "summary": summary,
    })


if __name__ == "__main__":
    main()
