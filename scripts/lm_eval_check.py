"""lm-evaluation-harness itself (`--model local-completions`, the `lm-eval` extra) against a
kvfence server on a tiny random llama checkpoint, on a multiple-choice task built here (a local
JSON file: no download), and every per-choice loglikelihood lm-eval logged compared with
transformers' on the same checkpoint (float32). Twice: cold, then after plain requests put every
prompt in the prefix cache. Not in CI: lm-eval pulls datasets, pandas, scikit-learn, ...

Run: python scripts/lm_eval_check.py [--pd] [--lm-eval-path DIR]
(`--lm-eval-path`: a directory lm-eval was pip-installed into with --target, if not the venv.)
Exit 0 when every choice is within --tol of transformers, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from checkpoints import build_checkpoint  # noqa: E402
from lm_eval_style import TASK, hf_loglikelihoods  # noqa: E402

from kvfence.tools.cluster import free_port  # noqa: E402

MODEL = "tiny-llama"
TASK_NAME = "kvfence_mc"


def write_task(work: Path) -> None:
    docs = work / "mc.jsonl"
    docs.write_text(
        "".join(json.dumps({"context": c, "choices": ch, "label": 0}) + "\n" for c, ch in TASK)
    )
    (work / f"{TASK_NAME}.yaml").write_text(
        f"task: {TASK_NAME}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {docs}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\n"
        'target_delimiter: ""\n'  # the choices carry their own leading space
        "metric_list:\n  - metric: acc\n"
    )


def start_server(model_dir: Path, port: int, pd: bool, log: Path) -> subprocess.Popen:
    common = ["--model", str(model_dir), "--served-model-name", MODEL, "--page-size", "4",
              "--port", str(port)]
    args = (["up", *common, "--prefill", "1", "--decode", "1"] if pd
            else ["serve", *common, "--kv-pool-tokens", "4096"])
    proc = subprocess.Popen([sys.executable, "-m", "kvfence.cli", *args],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit(f"the server never became healthy; see {log}")


def run_lm_eval(work: Path, model_dir: Path, port: int, out: Path, lm_eval_path: str | None):
    env = dict(os.environ)
    if lm_eval_path:
        env["PYTHONPATH"] = os.pathsep.join([lm_eval_path, env.get("PYTHONPATH", "")])
    model_args = (f"model={MODEL},base_url=http://127.0.0.1:{port}/v1/completions,"
                  f"tokenizer_backend=huggingface,tokenizer={model_dir},num_concurrent=1,"
                  "max_retries=1")
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", model_args, "--tasks", TASK_NAME, "--include_path", str(work),
           "--batch_size", "4", "--output_path", str(out), "--log_samples"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"lm_eval failed ({done.returncode}); see {out.parent / out.name}.log")
    [samples] = list(out.rglob(f"samples_{TASK_NAME}_*.jsonl"))
    return [json.loads(line) for line in samples.read_text().splitlines()]


def per_choice(samples: list[dict], model_dir: Path) -> list[tuple[float, float]]:
    """(lm-eval's loglikelihood, transformers') for every choice lm-eval scored."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs, got = [], []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        for arg, resp in zip(_arguments(s), s["resps"], strict=True):
            context, cont = arg["arg_0"], arg["arg_1"]
            whole = tok(context + cont, add_special_tokens=False)["input_ids"]
            ctx = tok(context, add_special_tokens=False)["input_ids"]
            pairs.append((ctx, whole[len(ctx):]))
            got.append(float(resp[0][0]))
    return list(zip(got, hf_loglikelihoods(model_dir, pairs), strict=True))


def _arguments(sample: dict) -> list[dict]:
    """A logged sample's (context, continuation) requests in choice order (lm-eval 0.4.13 logs
    them as {"gen_args_<i>": {"arg_0", "arg_1"}})."""
    args = sample["arguments"]
    return [args[f"gen_args_{i}"] for i in range(len(args))] if isinstance(args, dict) else args


def prime_cache(port: int, samples: list[dict]) -> int:
    """Plain requests for every full prompt, then the first again: the cached tokens it reports."""
    prompts = [a["arg_0"] + a["arg_1"] for s in samples for a in _arguments(s)]
    cached = 0
    for prompt in [*prompts, prompts[0]]:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
        r.raise_for_status()
        cached = r.json()["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return int(cached)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pd", action="store_true", help="kvfence up (router, 1 prefill, 1 decode)")
    ap.add_argument("--lm-eval-path", help="where lm-eval was installed with pip --target")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--work", type=Path, help="keep the files here (default: a temp dir)")
    args = ap.parse_args()
    torch.manual_seed(0)
    work = args.work or Path(tempfile.mkdtemp(prefix="kvfence-lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_checkpoint("llama", work / "ckpt")
    write_task(work)
    port = free_port()
    server = start_server(model_dir, port, args.pd, work / "server.log")
    worst = 0.0
    try:
        for label in ("cold", "cache-primed"):
            samples = run_lm_eval(work, model_dir, port, work / f"out-{label}", args.lm_eval_path)
            pairs = per_choice(samples, model_dir)
            diff = max(abs(a - b) for a, b in pairs)
            worst = max(worst, diff)
            print(f"{'pd' if args.pd else 'unified'} {label}: {len(pairs)} choices, "
                  f"max |lm-eval - transformers| = {diff:.2e}")
            for a, b in pairs:
                print(f"  {a:+.6f}  {b:+.6f}")
            if label == "cold":
                print(f"  primed: the first prompt again reports "
                      f"{prime_cache(port, samples)} cached tokens")
    finally:
        server.terminate()
        server.wait(60)
    print(f"{'OK' if worst < args.tol else 'FAIL'}: worst {worst:.2e} (tol {args.tol})")
    return 0 if worst < args.tol else 1


if __name__ == "__main__":
    raise SystemExit(main())
