"""Shared helpers for the benchmark scripts: the SmolLM-135M-shaped random checkpoint, command
logging, machine facts, JSON output and simple statistics. Never downloads anything."""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from kvfence.tools.ports import free_port  # noqa: F401  (the scripts take it from here)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# SmolLM-135M's shape (hidden 576, intermediate 1536, 30 layers, 9 heads, 3 KV heads, head_dim
# 64, vocab 49152, tied embeddings); weights are random, so the checkpoint is built here.
SMOL_SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=1,
)


def build_smol_checkpoint(out: Path, seed: int = 0, **overrides: object) -> Path:
    """A random-init Llama checkpoint of SmolLM-135M's shape (float32) plus a word-level
    tokenizer covering the whole vocabulary, written by transformers into `out`."""
    import shutil

    import torch
    import transformers as tf

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    # Built aside and renamed into place, so concurrent scripts never read a half-written one.
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    shape = {**SMOL_SHAPE, **overrides}
    cfg = tf.LlamaConfig(**shape)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval().to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    write_wordlevel_tokenizer(tmp, int(shape["vocab_size"]))  # type: ignore[arg-type]
    try:
        os.rename(tmp, out)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def write_wordlevel_tokenizer(out: Path, vocab: int) -> None:
    """One word per id ("<s>", "</s>", "w2", ...), so every id decodes and random text encodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": shape_ctx(out),
            }
        )
    )


def shape_ctx(out: Path) -> int:
    return int(json.loads((out / "config.json").read_text())["max_position_embeddings"])


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts avoiding ids 0 and 1 (BOS/EOS)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


def submit_prompts(engine, prompts: list[list[int]], max_tokens: int, ids) -> set[str]:  # type: ignore[no-untyped-def]
    """Submit greedy requests (EOS ignored) straight to an engine, ids drawn from the `ids`
    counter; the returned set gathers the ids of those that finish as the caller steps it."""
    from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams

    done: set[str] = set()

    def sink(o: RequestOutput) -> None:
        if o.finished:
            done.add(o.request_id)

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.submit(GenerateRequest(f"r{next(ids)}", "bench", tuple(prompt), params), sink)
    return done


# --pin: on a host of few cores, two processes streaming to each other over loopback tend to
# end up on one core taking turns while the other core idles (the receiver's wake-up is a sync
# one, placed on the sender's core), now and then for a whole transfer (benchmarks/RESULTS.md
# "KV transfer": perf showed it in every slow window). Across hosts, as PD runs, each side has
# cores of its own: pinned, each side of a pair gets one here too.
PIN_HELP = (
    "keep each sending side (and this process) on one core and each receiving side on another, "
    "as on two hosts: no turn-taking on one core while the other idles"
)


def pin_cores() -> tuple[int, int]:
    """The cores --pin uses: (sending side, receiving side)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs two cores")
    return cores[0], cores[1]


def on_core(core: int | None) -> Callable[[], None] | None:
    """A Popen preexec_fn keeping the child, and every thread it starts, on one core (or None:
    anywhere)."""
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def machine() -> dict[str, object]:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(
                cmd, shell=True, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except Exception as e:  # noqa: BLE001 - facts are best effort
            return f"unavailable: {e}"

    import torch

    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in sh("lscpu").splitlines()
            if line.startswith("Model name")
        ),
        platform.processor(),
    )
    return {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "nproc": sh("nproc"),
        "cpu_model": model,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # Other work shares this machine: the 1/5/15-minute load average when the run ended.
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "git": sh(f"git -C {ROOT} rev-parse --short HEAD"),
    }


def log_command(argv: Sequence[str], env: dict[str, str] | None = None) -> str:
    """Print (and return) the exact command line, with the env vars that matter for it."""
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    line = (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv)
    print(f"$ {line}", flush=True)
    return line


def this_command() -> str:
    return log_command([sys.executable.replace(str(ROOT) + "/", ""), *sys.argv])


def write_json(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


# Two-sided 95% Student t quantiles for small samples (df -> t).
_T95 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    19: 2.093,
    24: 2.064,
    29: 2.045,
}


def t95(df: int) -> float:
    if df in _T95:
        return _T95[df]
    below = [d for d in _T95 if d <= df]
    return _T95[max(below)] if below and df < 30 else 1.96


def ratio_ci(ratios: Sequence[float]) -> dict[str, float]:
    """Mean of per-pair ratios with a 95% t interval on their log (ratios are multiplicative)."""
    logs = [math.log(r) for r in ratios if r > 0 and math.isfinite(r)]
    if not logs:
        return {"mean": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    m = statistics.fmean(logs)
    if len(logs) < 2:
        return {"mean": math.exp(m), "lo": float("nan"), "hi": float("nan"), "n": len(logs)}
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"mean": math.exp(m), "lo": math.exp(m - half), "hi": math.exp(m + half), "n": len(logs)}


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib missing: pip install 'kvfence[bench]' for plots", file=sys.stderr)
        return False
    return True


def new_figure(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: Path) -> None:  # type: ignore[no-untyped-def]
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def env_threads() -> dict[str, str]:
    return {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}


class Server:
    """A `kvfence` (or any) server process: started, waited for on /health, stopped by its id."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        env: dict[str, str] | None = None,
        health: str = "/health",
        log: Path | None = None,
    ) -> None:
        self.argv, self.port, self.extra_env = argv, port, env or {}
        self.command = log_command(argv, self.extra_env)
        self.log = log
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self._out = out
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **self.extra_env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.health = health

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 300.0) -> None:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-2000:] if self.log else ""
                raise RuntimeError(f"server exited {self.proc.returncode}: {tail}")
            try:
                if httpx.get(self.url + self.health, timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.argv[:3]} not ready after {timeout}s")

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # the server and the workers it started
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=10)
        if self._out is not subprocess.DEVNULL:
            self._out.close()


def kvfence_bin() -> str:
    return str(Path(sys.executable).with_name("kvfence"))


def kvfence_server(
    mode: str,
    model: str | Path,
    context_length: int,
    kv_pool_tokens: int,
    log: Path,
    env: dict[str, str] | None = None,
    extra: Sequence[str] = (),
) -> Server:
    """`kvfence serve` (mode "serve") or a 1 prefill + 1 decode `kvfence up` (mode "up") on a
    free port, started (not yet ready): the servers the A/B scripts compare."""
    port = free_port()
    role = ["serve"] if mode == "serve" else ["up", "--prefill", "1", "--decode", "1"]
    argv = [kvfence_bin(), *role, "--model", str(model), "--port", str(port)]
    argv += ["--context-length", str(context_length), "--kv-pool-tokens", str(kv_pool_tokens)]
    argv += ["--log-level", "warning", *extra]
    return Server(argv, port, env, log=log)


# vLLM's CPU build (its own venv, benchmarks/setup_vllm.sh): KV space in GiB, both cores, loopback.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_HOST_IP": "127.0.0.1",
}


def vllm_server(
    python: str,
    model: str | Path,
    context_length: int,
    log: Path,
    prefix_caching: bool | None = False,
    extra: Sequence[str] = (),
    dtype: str = "float32",
    eager: bool = False,
) -> Server:
    """vLLM's OpenAI API server on a free port, started (not yet ready), as its users run it:
    compiled (`eager` only for a run that says why). prefix_caching: on, off, or None for no
    flag (vLLM's own default). `vllm serve` resolves once benchmarks/setup_vllm.sh has made the
    venv."""
    port = free_port()
    argv = [str(Path(python).with_name("vllm")), "serve", str(model)]
    argv += ["--port", str(port), "--dtype", dtype, *(["--enforce-eager"] if eager else [])]
    if prefix_caching is not None:
        argv += ["--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    argv += ["--max-model-len", str(context_length), *extra]
    return Server(argv, port, VLLM_ENV, log=log)


def interleaved_pairs(
    sides: dict[str, Server],
    pairs: int,
    run: Callable[[Server, int], dict],
    metrics: dict[str, Callable[[dict], float]],
    label: str,
) -> list[dict[str, dict[str, float]]]:
    """A/B over two started servers, both kept up for the whole run and stopped at the end:
    `pairs` rounds of run(server, seed) on each, the side that goes first alternating so drift
    and warm-up favour neither. Per pair, each side's metrics; a line per pair shows the first
    side's over the second's."""
    a, b = sides
    out = []
    try:
        for srv in sides.values():
            srv.wait_ready()
        for i in range(pairs):
            order = [a, b] if i % 2 == 0 else [b, a]
            res = {side: run(sides[side], i) for side in order}
            out.append({side: {k: f(res[side]) for k, f in metrics.items()} for side in (a, b)})
            ratios = " ".join(f"{k}={out[-1][a][k] / out[-1][b][k]:.3f}" for k in metrics)
            print(f"[{label}] pair {i + 1}/{pairs} {a}/{b}: {ratios}", flush=True)
    finally:
        for srv in sides.values():
            srv.stop()
    return out


def run_bench(
    url: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int | None,
    vocab: int,
    seed: int = 0,
    warmup: int = 1,
    progress: bool = False,
) -> dict:
    """One `kvfence bench serve` run in-process; logs the equivalent command."""
    import asyncio

    from kvfence.tools import bench

    argv = [
        "serve",
        "--base-url",
        url,
        "--num-prompts",
        str(num_prompts),
        "--input-len",
        str(input_len),
        "--output-len",
        str(output_len),
        "--vocab-size",
        str(vocab),
        "--seed",
        str(seed),
        "--warmup",
        str(warmup),
    ]
    if concurrency:
        argv += ["--concurrency", str(concurrency)]
    if not progress:
        argv.append("--no-progress")
    log_command(["kvfence", "bench", *argv])
    code, result = asyncio.run(bench.bench(bench.parse_args(argv[1:])))
    if code != 0:
        raise RuntimeError(f"bench failed ({code}): {result.get('error') or result.get('errors')}")
    return result


TINY_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
}


def add_http_ab_args(p: argparse.ArgumentParser, name: str, num_prompts: int) -> None:
    """The flags of an interleaved A/B of two servers over HTTP (up_threads, pd_before_after)."""
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--kv-pool-tokens", type=int, default=20480)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default=name)


def add_lora_workload_args(p: argparse.ArgumentParser) -> None:
    """The offline mixed-adapter workload of lora_mixed.py and lora_vs_vllm.py (issue 46)."""
    p.add_argument("--model", help="model directory (default: a SmolLM-135M-shaped one)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer stand-in (smoke runs)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)


def http_ab_workload(a: argparse.Namespace, model: Path) -> dict[str, object]:
    keys = ("num_prompts", "input_len", "output_len", "concurrency", "pairs")
    return {k: getattr(a, k) for k in keys} | {"model": str(model)}


def bench_model(model: str | None, tiny: bool) -> Path:
    """The checkpoint a benchmark runs: the given one, else the SmolLM-135M-shaped one built
    locally (or a 2-layer stand-in of it for the smoke tests)."""
    if model:
        return Path(model)
    name = "kvfence-bench-tiny" if tiny else "kvfence-bench-smol135"
    return build_smol_checkpoint(Path(tempfile.gettempdir()) / name, **(TINY_SHAPE if tiny else {}))


def kernel_at(rev: str, stem: str) -> Callable:
    """The native kernel `stem` (kvfence/model/kernels/<stem>.cpp) compiled from its source and
    the shared headers as they were at git revision `rev` (those a revision had),
    under a name of its own: a change's old side, timed in the same process as the tree's."""
    return getattr(module_at(rev, stem), stem)


def module_at(rev: str, stem: str) -> object:
    """kernel_at's whole extension module (every function `<stem>.cpp` defines)."""
    from torch.utils.cpp_extension import load

    from kvfence.model.kernels import CFLAGS, HEADERS, HERE, LDFLAGS

    root = Path(__file__).resolve().parent.parent
    folder = HERE.relative_to(root)
    shown = {
        name: subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:{folder / name}"],
            capture_output=True, text=True,
        )
        for name in (f"{stem}.cpp", *(h.name for h in HEADERS))
    }
    shown[f"{stem}.cpp"].check_returncode()
    texts = {name: r.stdout for name, r in shown.items() if r.returncode == 0}
    tree = {name: (HERE / name).read_text() for name in shown}
    if texts == tree:  # the revision's sources are the tree's: its build is the one already made
        from kvfence.model import kernels

        mod = kernels._build(stem)
        if mod is not None:
            return mod
    key = hashlib.sha256("".join(texts.values()).encode()).hexdigest()[:12]
    build = Path(tempfile.mkdtemp(prefix="kvfence-kernel-at-"))
    for name, text in texts.items():
        (build / name).write_text(text)
    return load(name=f"kvfence_bench_{stem}_{key}", sources=[str(build / f"{stem}.cpp")],
                extra_cflags=CFLAGS, extra_ldflags=LDFLAGS)
