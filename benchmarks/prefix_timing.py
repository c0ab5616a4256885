"""The prefix cache's timing side channel over HTTP (issue 16, point 6), wall-clock TTFT:

  within a tenant   A re-sends a prompt it sent before and a fresh one of equal length
  across tenants    A sends a random prompt; B sends that prompt and a fresh one of equal length
  twin              the same across tenants on a server started with the fault point
                    prefix_cache_ignore_namespace (keys and checks drop the namespace)

Each pair goes in random order on one `kvfence serve` with two API keys, or with `--pd 2x2` on
a `kvfence up` of 2 prefills + 2 decodes behind the cache-aware router (issue 18), where the
twin loses the tenant at every hop: the workers' caches ignore the namespace and the router's
index ignores the tenant (fault router_ignore_tenant), so B follows A to A's workers.
Reported per arm:
ROC AUC of the fresh prompts' TTFT over the probed ones' (0.5: no threshold tells them apart)
and the two-sample KS p-value; the goals are within AUC > 0.9, across |AUC - 0.5| <= 0.05 and
KS p > 0.01, twin AUC > 0.9. tests/test_prefix_timing.py asserts the same in-process.

    .venv/bin/python benchmarks/prefix_timing.py --pairs 200 --prompt-len 1024
    .venv/bin/python benchmarks/prefix_timing.py --pairs 200 --prompt-len 1024 --pd 2x2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

from benchmarks.common import (  # noqa: E402
    RESULTS,
    Server,
    bench_model,
    free_port,
    kvfence_bin,
    kvfence_server,
    machine,
    this_command,
    write_json,
)
from kvfence.tools.leakcheck.timing_stats import auc, ks_pvalue, ks_statistic  # noqa: E402

KEYS = {"A": "timing-key-a", "B": "timing-key-b"}
FAULTS = {"KVFENCE_FAULT_INJECTION": "1", "KVFENCE_FAULTS": "prefix_cache_ignore_namespace"}
# Through the router: every process of the cluster arms what applies to it.
FAULTS_PD = {**FAULTS, "KVFENCE_FAULTS": "prefix_cache_ignore_namespace,router_ignore_tenant"}


def ttft_ms(client: httpx.Client, model: str, tenant: str, prompt: list[int]) -> float:
    """Wall time from sending the request to the first streamed token."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return (time.perf_counter() - t0) * 1e3
    raise RuntimeError("the stream ended without a token")


def arm(url: str, model: str, pairs: int, n: int, vocab: int, prober: str, seed: int) -> dict:
    """A caches a random prompt (or, within a tenant, the prober re-sends its own); the prober
    sends it and a fresh one, in random order."""
    rng = random.Random(seed)

    def fresh() -> list[int]:
        return [rng.randrange(8, vocab) for _ in range(n)]

    probed, control = [], []
    with httpx.Client(base_url=url, timeout=300, trust_env=False) as client:
        for _ in range(pairs):
            secret, other = fresh(), fresh()
            ttft_ms(client, model, "A", secret)
            sides = [(probed, secret), (control, other)]
            rng.shuffle(sides)
            for sink, prompt in sides:
                sink.append(ttft_ms(client, model, prober, prompt))
    hits, fresh = np.array(probed), np.array(control)
    return {
        "pairs": pairs,
        "auc_fresh_over_probed": auc(hits, fresh),
        "ks_p": ks_pvalue(ks_statistic(hits, fresh), len(hits), len(fresh)),
        "ttft_p50_ms_probed": statistics.median(probed),
        "ttft_p50_ms_fresh": statistics.median(control),
    }


def serve(model: Path, a: argparse.Namespace, keys: Path, env: dict[str, str] | None, log: Path):
    """`kvfence serve`, or with --pd PxD a `kvfence up` of P prefills and D decodes."""
    extra = ["--api-key-file", str(keys), "--served-model-name", "m"]
    if a.pd is None:
        srv = kvfence_server("serve", model, a.context_length, a.pool_tokens, log, env, extra)
    else:
        n_prefill, n_decode = a.pd
        port = free_port()
        argv = [kvfence_bin(), "up", "--prefill", str(n_prefill), "--decode", str(n_decode),
                "--model", str(model), "--port", str(port), "--context-length",
                str(a.context_length), "--kv-pool-tokens", str(a.pool_tokens), "--log-level",
                "warning", *extra]  # fmt: skip
        srv = Server(argv, port, env, log=log)
    srv.wait_ready(timeout=900)
    return srv


def pd_shape(value: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in value.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError("expected PxD, e.g. 2x2") from None
    if p < 1 or d < 1:
        raise argparse.ArgumentTypeError("at least one prefill and one decode")
    return p, d


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: build the SmolLM-135M-shaped one")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke)")
    p.add_argument("--pairs", type=int, default=200)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--pool-tokens", type=int, default=65536)
    p.add_argument("--vocab", type=int, default=None, help="token ids drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--pd", type=pd_shape, default=None, metavar="PxD",
                   help="a `kvfence up` of P prefills and D decodes (cache-aware router)")
    a = p.parse_args(argv)
    model = bench_model(a.model, a.tiny)
    vocab = a.vocab or json.loads((model / "config.json").read_text())["vocab_size"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kvfence-timing-"))
    keys = tmp / "keys.txt"
    keys.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    results: dict[str, dict] = {}
    twin = FAULTS if a.pd is None else FAULTS_PD
    tag = "" if a.pd is None else f"-pd{a.pd[0]}x{a.pd[1]}"
    for name, env, prober in (("within", None, "A"), ("across", None, "B"), ("twin", twin, "B")):
        srv = serve(model, a, keys, env, out / f"prefix_timing{tag}-{name}-server.log")
        try:
            arm(srv.url, "m", 3, a.prompt_len, vocab, prober, seed=a.seed + 999)  # warm up
            results[name] = arm(srv.url, "m", a.pairs, a.prompt_len, vocab, prober, a.seed)
        finally:
            srv.stop()
        r = results[name]
        print(
            f"{name:7s} AUC {r['auc_fresh_over_probed']:.3f}  KS p {r['ks_p']:.3g}  "
            f"TTFT p50 probed {r['ttft_p50_ms_probed']:.1f} ms, "
            f"fresh {r['ttft_p50_ms_fresh']:.1f} ms",
            flush=True,
        )
    goals = {
        "within AUC > 0.9": results["within"]["auc_fresh_over_probed"] > 0.9,
        "across |AUC - 0.5| <= 0.05": abs(results["across"]["auc_fresh_over_probed"] - 0.5) <= 0.05,
        "across KS p > 0.01": results["across"]["ks_p"] > 0.01,
        "twin AUC > 0.9": results["twin"]["auc_fresh_over_probed"] > 0.9,
    }
    for goal, met in goals.items():
        print(f"{'met' if met else 'MISSED'}: {goal}")
    write_json(
        out / f"prefix_timing{tag}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "model": str(model),
            "pd": a.pd,
            "prompt_len": a.prompt_len,
            "results": results,
            "goals": goals,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
