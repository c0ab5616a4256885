"""The benchmark scripts and `kvfence bench serve` keep working: each script runs on a tiny
configuration (no timing is asserted; speed is measured in benchmarks/, never here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"

SMOKE = {
    "guard_overhead": [
        "--i-understand-guards-off-is-unsafe",
        "--pairs",
        "2",
        "--num-prompts",
        "2",
        "--input-len",
        "32",
        "--output-len",
        "4",
        "--concurrency",
        "2",
        "--micro-repeats",
        "1",
    ],
    "vs_engines": [
        "--tiny",
        "--engines",
        "kvfence,hf",
        "--rounds",
        "1",
        "--num-prompts",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--concurrency",
        "",
    ],
    "kv_transfer": ["--prompt-len", "64", "--repeats", "1", "--backends", "tcp"],
    # Before = this tree's HEAD: CI may have no `main`; the workers find the suite's certificates.
    "tls_transfer": ["--prompt-len", "64", "--repeats", "1", "--before-ref", "HEAD"],
    "prefix_timing": [
        "--tiny",
        "--pairs",
        "2",
        "--prompt-len",
        "32",
        "--context-length",
        "256",
        "--pool-tokens",
        "4096",
    ],
    "pd_vs_unified": [
        "--lengths",
        "32,64",
        "--num-prompts",
        "1",
        "--output-len",
        "4",
        "--rounds",
        "1",
    ],
    # The tree against itself: the smoke test needs a base checkout, and this one is at hand.
    "before_after": [
        "--base",
        str(ROOT),
        "--tiny",
        "--pairs",
        "1",
        "--num-prompts",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "4",
    ],
    "linear_kernels": ["--tiny", "--rows", "1,8", "--repeats", "1"],
    "fused_epilogue": ["--tiny", "--batches", "1,2", "--steps", "3", "--alternations", "1"],
    "bf16_step": ["--tiny", "--batches", "1,2", "--steps", "3", "--alternations", "1",
                  "--sides", "bfloat16-onednn,bfloat16"],
    "bf16_gemm": ["--tiny", "--reps", "1", "--rows", "1,9", "--prefill-rows", "64"],
    "kernels_at": ["--tiny", "--base-rev", "HEAD", "--rounds", "1", "--steps", "2", "--rows", "2",
                   "--context", "24", "--prefill", "2x16", "--contend", "0.1"],
    "moe_step": ["--tiny", "--batches", "1", "--steps", "2"],
    "up_threads": [
        "--tiny",
        "--pairs",
        "1",
        "--num-prompts",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--kv-pool-tokens",
        "4096",
    ],
    "itl_tail": [
        "--tiny",
        "--no-vllm",
        "--runs",
        "2:kvfence",
        "--repeats",
        "1",
        "--num-prompts",
        "2",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--pool-tokens",
        "4096",
    ],
    "step_budget_sim": [],
    "waves_sim": ["--prompts", "16"],
    "waves_cut_sim": ["--prompts", "16", "--seeds", "2"],
    "pd_local_sim": [],
    "lora_mixed": ["--tiny", "--prompts", "2", "--prompt-len", "16", "--max-tokens", "4",
                   "--pairs", "1"],
    "lora_vs_vllm": ["--tiny", "--engines", "kvfence", "--prompts", "2", "--prompt-len", "16",
                     "--max-tokens", "4", "--rounds", "1"],
    "decode_floor": [
        "--tiny",
        "--prompt-len",
        "8",
        "--output-len",
        "4",
        "--repeats",
        "1",
        "--bandwidth-mib",
        "16",
    ],
}


# The smoke starts ~35 processes at once on two cores. Torch's OpenMP threads spin-wait after
# each parallel region by default, burning the cores the other processes are waiting for (13%
# and 29% of the smoke's CPU time in two paired runs on a 2-core machine); one thread each,
# waiting passively, changes nothing a smoke checks. Scripts that pass --threads still get
# their threads.
SMOKE_ENV = {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.serial  # ~35 processes: both cores, alone
def test_every_benchmark_script_runs_on_a_tiny_configuration(tmp_path: Path) -> None:
    # All at once: most of their time is process start-up and model loading, not compute.
    procs = {
        name: subprocess.Popen(
            [sys.executable, str(BENCH / f"{name}.py"), *args, "--out", str(tmp_path)],
            cwd=ROOT,
            env={**os.environ, **SMOKE_ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a timed-out script is stopped with the servers it started
        )
        for name, args in SMOKE.items()
    }
    failures = []
    try:
        for name, p in procs.items():
            out, _ = p.communicate(timeout=240)
            if p.returncode != 0:
                failures.append(f"{name}: exit {p.returncode}\n{out[-3000:]}")
                continue
            data = json.loads((tmp_path / f"{name}.json").read_text())
            assert data["command"] and data["machine"]["nproc"], name
            assert "$ " in out, f"{name} did not print the commands it ran"
    finally:
        # After a failure: SIGINT runs each script's finally, which stops the servers it started
        # (in sessions of their own); what still runs after that is killed.
        running = [p for p in procs.values() if p.poll() is None]
        for p in running:
            os.killpg(p.pid, signal.SIGINT)
        for p in running:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    assert not failures, "\n\n".join(failures)


def test_guard_overhead_refuses_without_the_unsafe_flag(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, str(BENCH / "guard_overhead.py"), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "--i-understand-guards-off-is-unsafe" in p.stderr
    assert not (tmp_path / "guard_overhead.json").exists()


def test_bench_metrics_from_records() -> None:
    from kvfence.tools.bench import RequestRecord, metrics

    recs = [
        RequestRecord(
            0, 10, ok=True, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1, 0.1, 0.1, 0.1]
        ),
        RequestRecord(1, 10, ok=False, error="HTTP 500"),
    ]
    m = metrics(recs, wall=1.0)
    assert (m["completed"], m["failed"]) == (1, 1)
    assert m["total_input_tokens"] == 10 and m["total_output_tokens"] == 5
    assert m["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert m["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert m["itl_ms"]["p99"] == pytest.approx(100.0)


def test_bench_cli_cannot_run_against_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfence.tools.bench import EXIT_CANNOT_RUN, main

    assert (
        main(
            [
                "serve",
                "--base-url",
                "http://127.0.0.1:9",
                "--num-prompts",
                "1",
                "--timeout",
                "2",
                "--no-progress",
            ]
        )
        == EXIT_CANNOT_RUN
    )
    assert "cannot reach" in capsys.readouterr().out


def test_bench_datasets_shape() -> None:
    from kvfence.tools.bench_datasets import DatasetArgs, make_sessions, shared_prefixes

    keys = ("k1", "k2", "k3")
    a = DatasetArgs("shared-prefix", 0, 0, 500, 7, False, keys, "per-tenant",
                    num_groups=4, prompts_per_group=3, system_prompt_len=32, question_len=8)
    sessions = make_sessions(a)
    assert len(sessions) == 12 and all(len(s.turns[0]) == 40 for s in sessions)
    systems = {}
    for s in sessions:
        systems.setdefault(tuple(s.turns[0][:32]), set()).add((s.api_key, s.extra["cache_salt"]))
    # a system prompt per group, each sent by one tenant with that tenant's salt
    assert len(systems) == 4 and all(len(v) == 1 for v in systems.values())
    assert len({s.extra["cache_salt"] for s in sessions}) == 3
    assert len(shared_prefixes(sessions, 32)) == 4
    one = make_sessions(DatasetArgs("shared-prefix", 0, 0, 500, 7, False, keys,
                                    num_groups=4, prompts_per_group=3, system_prompt_len=32,
                                    question_len=8, one_system_prompt=True))
    assert len(shared_prefixes(one, 32)) == 1 and one[0].extra == {}
    chat = make_sessions(DatasetArgs("multi-turn", 5, 16, 500, 7, True, keys, num_turns=3))
    assert [s.api_key for s in chat] == ["k1", "k2", "k3", "k1", "k2"]
    assert all(len(s.turns) == 3 for s in chat)


def test_bench_multi_turn_sends_each_answer_back_per_tenant() -> None:
    import asyncio

    from fake_engine import BOS, FakeEngine
    from fake_workers import ServerThread

    from kvfence.server.api import build_app
    from kvfence.tools.bench import bench, parse_args

    engine = FakeEngine()
    engine.start()
    server = ServerThread(build_app(engine, api_keys={"ka": "tenant-a", "kb": "tenant-b"}))
    server.start()
    try:
        args = parse_args([
            "--base-url", server.url, "--api-key", "ka", "--api-key", "kb",
            "--dataset", "multi-turn", "--num-prompts", "4", "--num-turns", "3",
            "--input-len", "6", "--question-len", "3", "--output-len", "4",
            "--concurrency", "2", "--warmup", "0", "--no-progress",
        ])
        code, result = asyncio.run(bench(args))
    finally:
        server.stop()
        engine.shutdown()
    assert code == 0, result
    assert result["completed"] == 12 and result["tenants"] == 2
    sent = [r for r in engine.submitted if r.sampling.max_tokens == 4]  # not bench's probe
    prompts = [bytes(t for t in r.prompt_token_ids if t != BOS) for r in sent]
    assert {r.tenant for r in sent} == {"tenant-a", "tenant-b"}
    firsts = [p for p in prompts if not any(q != p and p.startswith(q) for q in prompts)]
    assert len(firsts) == 4
    # every later turn extends an earlier prompt of the same tenant by its answer and a question
    for r, p in zip(sent, prompts, strict=True):
        if p in firsts:
            continue
        parents = [
            q for s, q in zip(sent, prompts, strict=True)
            if q != p and p.startswith(q) and s.tenant == r.tenant
        ]
        assert parents, p


def test_a_chats_next_turn_keeps_the_previous_prompts_words_apart_from_its_answer() -> None:
    from kvfence.tools.bench import next_turn

    # Glued, "w47" and "w45" would tokenize as one word and the cached prompt end would miss.
    assert next_turn("w12 w47", "w45 w46", "w9") == "w12 w47 w45 w46 w9"
    assert next_turn("w12 w47", " w45", "w9") == "w12 w47 w45 w9"  # a BPE answer's own space
    assert next_turn("w12 w47", "", "w9") == "w12 w47 w9"
