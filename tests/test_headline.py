"""The README's performance table is the rendering of benchmarks/results/headline.json (what
`make bench` writes), so the README never claims a figure the committed results do not hold."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("headline", REPO / "benchmarks" / "headline.py")
assert _spec is not None and _spec.loader is not None
headline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(headline)


def committed() -> dict:
    if not headline.HEADLINE.is_file():
        pytest.skip("benchmarks/results/headline.json is absent: `make bench` writes it")
    return json.loads(headline.HEADLINE.read_text())


def test_readme_table_is_the_rendering_of_headline_json():
    table = headline.readme_table(headline.README.read_text())
    assert table == headline.render_table(committed()), (
        "README.md's headline table differs from benchmarks/results/headline.json: run "
        "`python -m benchmarks.headline readme`"
    )


def test_recorded_rows_still_say_what_their_result_files_say():
    h = committed()
    if h["kind"] != "recorded":
        pytest.skip(f"headline.json is {h['kind']!r}, not built from recorded files")
    assert h == json.loads(json.dumps(headline.recorded_headline()))


def test_a_peer_that_did_not_run_is_shown_as_such_never_as_a_ratio():
    src = {"file": "x.json", "git": "abc1234", "date": "2026-12-05 06:00", "host": "cpu, 2 cores"}
    rows = [
        headline.row("W", "throughput, tok/s", "higher", 500.0, None, "vLLM not run", src),
        headline.row("W", "TTFT p50, ms", "lower", 50.0, 100.0, "vLLM", src),
    ]
    out = headline.render_table({"title": "t", "rows": rows}).splitlines()
    assert "| 500 | not run (vLLM not run) | - |" in out[4]
    assert "| 50 | 100 (vLLM) | 0.50 |" in out[5]
    assert all("`x.json`, `abc1234`" in line for line in out[4:6])


def test_a_run_with_latency_targets_says_them_and_reports_goodput_at_them():
    def cell(x: float) -> dict:
        return {"median": x, "min": x, "max": x}

    metrics = ["throughput", "ttft_p50_ms", "itl_p99_ms", "goodput_ttft2s_tpot100ms"]
    side = {m: cell(1.0) for m in [*metrics, "goodput_ttft4s_tpot50ms"]}
    run = {
        "command": "goodput.py --kvfence-args '--target-tpot-ms 50 --target-ttft-ms 4000'",
        "machine": {"git": "abc1234", "date": "2026-12-06T00:00", "nproc": "2"},
        "workload": {"num_prompts": 48, "input_len": 256, "output_len": 64},
        "summary": {"c8": {"serve": side, "vllm": {**side, "goodput_ttft4s_tpot50ms": cell(0.5)}}},
    }
    # Recorded before goodput.py wrote kvfence_args: read back from its command.
    rows = headline.http_rows(Path("goodput_waves.json"), run)
    assert {r["workload"] for r in rows} == {
        "HTTP 48 x 256 -> 64, C=8, kvfence serve, `--target-tpot-ms 50 --target-ttft-ms 4000`"
    }
    at_target = [r for r in rows if "(the targets)" in str(r["metric"])]
    assert [(r["metric"], r["kvfence"], r["peer"]) for r in at_target] == [
        ("goodput at TTFT 4 s + TPOT 50 ms (the targets), req/s", 1.0, 0.5)
    ]
    # A run at the defaults says no flags and has no targets' cell.
    plain = headline.http_rows(Path("goodput.json"), {**run, "kvfence_args": ""})
    assert len(plain) == len(metrics)
    assert all(str(r["workload"]).endswith("C=8, kvfence serve") for r in plain)
