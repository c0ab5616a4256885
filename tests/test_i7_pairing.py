"""I7 pairing: prefill and decode exchange pool capacity, context, page size, dtype, KV layout
and a model fingerprint at bootstrap; any mismatch refuses the pair, in both logs, the workers'
/pd/info and the router's /health. Twin: skip_pairing_check."""

from __future__ import annotations

import httpx
from conftest import hf_greedy, random_prompts
from pd_harness import PDPair, Result
from procs import OPERATOR, Proc, free_port, serve
from waiting import wait_for

from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.faults import Faults

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def ask(pair: PDPair) -> Result:
    _, r = pair.submit(random_prompts([30], 256, seed=3)[0], GREEDY)
    assert isinstance(r, Result) and r.done.wait(30)
    return r


def mismatched(checkpoint_dir, faults: Faults | None = None) -> PDPair:
    """Prefill serves one checkpoint, decode another of the same shape (different weights)."""
    return PDPair(
        str(checkpoint_dir("llama")),
        faults=faults,
        decode_model=str(checkpoint_dir("llama", seed=1)),
        kv_pool_tokens=512,
        context_length=128,
    )


def test_i7_different_weights_refuse_to_pair(checkpoint_dir, caplog) -> None:
    pair = mismatched(checkpoint_dir)
    try:
        r = ask(pair)
        assert r.final.finish_reason is FinishReason.ERROR and r.final.error_status == 503
        assert "model_fingerprint differs" in r.final.error
        assert pair.prefill.transfer_stats.get("pairing_refused") == 1
        assert "model_fingerprint" in next(iter(pair.decode.pairing_errors.values()))
        assert "refusing to pair" in caplog.text
        assert pair.wait_idle()
    finally:
        pair.close()


def test_i7_twin_without_the_check_a_foreign_model_answers_wrongly(checkpoint_dir) -> None:
    with Faults().injected("skip_pairing_check") as faults:
        pair = mismatched(checkpoint_dir, faults)
        try:
            r = ask(pair)
        finally:
            pair.close()
    assert r.final.finish_reason is FinishReason.LENGTH  # a 200 ...
    prompt = random_prompts([30], 256, seed=3)[0]
    right = hf_greedy(checkpoint_dir("llama", seed=1), [prompt], 8)[0]
    assert r.token_ids != right  # ... with the wrong answer: decode used KV of other weights


def test_i7_page_size_mismatch_shows_in_router_health(tmp_path) -> None:
    prefill = serve("prefill", tmp_path, "--page-size", "16")
    decode = serve("decode", tmp_path, "--page-size", "32")
    router = None
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        port = free_port()
        router = Proc(
            [
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--port",
                str(port),
                "--health-interval",
                "0.5",
            ],
            port,
            tmp_path / "router.log",
        )

        def refused() -> bool:
            try:
                body = httpx.get(f"{router.url}/health", timeout=2, headers=OPERATOR).json()
            except httpx.HTTPError:
                return False
            return any("page_size" in e["error"] for e in body.get("pairing_errors", []))

        wait_for(refused, 60, lambda: (tmp_path / "router.log").read_text()[-2000:], interval=0.1)
        assert httpx.get(f"{router.url}/health").status_code == 503
    finally:
        for p in (router, decode, prefill):
            if p is not None:
                p.stop()

