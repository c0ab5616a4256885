"""benchmarks/goodput.py's grid: requests/s meeting both a TTFT and a TPOT target, from the
client's per-request records, TPOT as vLLM's client computes it; a failed request is never good."""

from __future__ import annotations

import pytest

from benchmarks.goodput import ALT, goodput_grid, per_request, summarise_runs


def _result() -> dict:
    return {
        "duration": 10.0,
        # ttft 0.5 s, 64 tokens at 40 ms; ttft 1.5 s, 64 tokens at 120 ms; a failure; 1 token
        "ttfts": [0.5, 1.5, 0.0, 3.0],
        "itls": [[0.04] * 63, [0.12] * 63, [], []],
        "output_lens": [64, 64, 0, 1],
        "errors": ["", "", "timeout", ""],
    }


def test_per_request_tpot_is_latency_after_the_first_token_per_token() -> None:
    reqs = per_request(_result())
    assert reqs[0] == pytest.approx((0.5, 0.04))
    assert reqs[1] == pytest.approx((1.5, 0.12))
    assert reqs[2] == (float("inf"), float("inf"))
    assert reqs[3] == (3.0, 0.0)


def test_grid_counts_requests_meeting_both_targets_per_second() -> None:
    g = goodput_grid(_result())
    assert g["ttft1s_tpot50ms"] == pytest.approx(0.1)  # the first only
    assert g["ttft1s_tpot200ms"] == pytest.approx(0.1)  # the second misses TTFT 1 s
    assert g["ttft2s_tpot100ms"] == pytest.approx(0.1)  # the second misses TPOT 100 ms
    assert g["ttft2s_tpot200ms"] == pytest.approx(0.2)
    assert g["ttft4s_tpot200ms"] == pytest.approx(0.3)  # the 1-token one; never the failure


def test_ratios_pair_passes_and_skip_the_records() -> None:
    def run(side: str, p: int, g: float) -> dict:
        return {"side": side, "concurrency": 8, "pass": p, "goodput_ttft2s_tpot100ms": g,
                "requests": [[0.1, 0.01]]}

    runs = [run("serve", 0, 2.0), run("vllm", 0, 1.0), run("serve", 1, 1.0), run("vllm", 1, 2.0)]
    cell = summarise_runs(runs, ["serve", "vllm"], [8])["c8"]
    ratio = cell["serve_over_vllm"]["goodput_ttft2s_tpot100ms"]
    assert (ratio["min"], ratio["max"]) == (0.5, 2.0)
    assert "requests" not in cell["serve"]


def test_the_alt_side_pairs_with_serve_and_vllm() -> None:
    def run(side: str, g: float) -> dict:
        return {"side": side, "concurrency": 32, "pass": 0, "goodput_ttft2s_tpot100ms": g}

    runs = [run("serve", 0.5), run(ALT, 1.0), run("vllm", 0.25)]
    cell = summarise_runs(runs, ["serve", ALT, "vllm"], [32])["c32"]
    assert cell[f"{ALT}_over_serve"]["goodput_ttft2s_tpot100ms"]["median"] == 2.0
    assert cell[f"{ALT}_over_vllm"]["goodput_ttft2s_tpot100ms"]["median"] == 4.0
