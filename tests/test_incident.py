"""The incident as a regression test, end to end through `kvfence up` on the bundled model.

The prefill pool is smaller than the context length (the report's fault 1, preflight waived for
the test). Tenant A's canary-dense prompts cycle through decode's pages; then tenant B sends a
prompt that fits the context but not the prefill pool.

A's canaries come from a fixed seed: the recall model's output over stale pages is a pure
function of A's prompt (which sets where each stale token lands relative to B's decode position),
so random canaries made the twin leak for about 19 draws in 20 and print nothing for the rest.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
from conftest import TINY_MODEL

from kvfence.tools.cluster import LocalCluster

CTX, PREFILL_POOL, DECODE_POOL = 2048, 1024, 2048
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
GUARDS_OFF = "skip_count_check,skip_checksum,skip_tag_check"
CANARY_SEED = 20261201  # any fixed seed whose layout the recall model copies; see the docstring


class Up(LocalCluster):
    def __init__(self, tmp: Path, faults: str = "") -> None:
        super().__init__(
            tmp,
            TINY_MODEL,
            "--context-length",
            str(CTX),
            "--prefill-kv-pool-tokens",
            str(PREFILL_POOL),
            "--decode-kv-pool-tokens",
            str(DECODE_POOL),
            "--unsafe-skip-preflight",
            keys=KEYS,
            env={"KVFENCE_FAULT_INJECTION": "1", "KVFENCE_FAULTS": faults},
        )

    def post(self, prompt: str, key: str, max_tokens: int = 32) -> httpx.Response:  # type: ignore[override]
        body = {
            "model": "kvfence-tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        return super().post(body, key)

    def pages_used(self, role: str) -> int:  # type: ignore[override]
        return self.role_pages_used(role)


def canary_prompt(canaries: list[str], lines: int) -> str:
    """Tenant A: nothing but canary records, so any span a stale read copies carries one."""
    return "".join(f"vault {i % 97}: {canaries[i % len(canaries)]}\n" for i in range(lines))


def make_canaries() -> list[str]:
    """Tenant A's 64 secrets: random-looking, the same every run (not a secret of anyone)."""
    rng = random.Random(CANARY_SEED)
    return [f"Cz{rng.getrandbits(48):012x}" for _ in range(64)]


def leaked(text: str, canaries: list[str]) -> bool:
    """Any 8+ character piece of any of A's canaries in B's output."""
    return any(c[i : i + 8] in text for c in canaries for i in range(len(c) - 7))


def run_incident(tmp: Path, faults: str) -> tuple[Up, list[str], httpx.Response, dict, dict]:
    up = Up(tmp, faults)
    try:
        canaries = make_canaries()
        r, before, after = bait_and_ask(up, canaries)
    except BaseException:
        up.stop()  # the callers' finally blocks only start once we return
        raise
    return up, canaries, r, before, after


def bait_and_ask(up: Up, canaries: list[str]) -> tuple[httpx.Response, dict, dict]:
    for _ in range(3):  # A's 900-token prompts cycle through all of decode's pages
        r = up.post(canary_prompt(canaries, 48), "key-a", max_tokens=4)
        assert r.status_code == 200, r.text
    before = {"prefill": up.counters("prefill"), "decode": up.counters("decode")}
    b_prompt = "The river ran slow past the mill and the day was long. " * 68  # ~1500 tokens
    r = up.post(b_prompt, "key-b")
    after = {"prefill": up.counters("prefill"), "decode": up.counters("decode")}
    return r, before, after


def test_incident_all_guards_on_b_gets_400_and_nothing_is_transferred(tmp_path: Path) -> None:
    up, _, r, before, after = run_incident(tmp_path, "")
    try:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "exceeds_kv_pool"
        assert after["prefill"].get("pages_sent") == before["prefill"].get("pages_sent")
        assert after["prefill"].get("rejected", 0) == before["prefill"].get("rejected", 0) + 1
        assert up.pages_used("prefill") == 0 and up.pages_used("decode") == 0
    finally:
        up.stop()


def test_incident_placeholder_with_other_guards_on_fails_closed(tmp_path: Path) -> None:
    up, canaries, r, _, after = run_incident(tmp_path, "placeholder_on_reject")
    try:
        # The README's error table: a transfer that fails closed is a retryable 503; a tag
        # check that caught unwritten pages is a guard's 500.
        code = r.json()["error"]["code"]
        want = {"kv_transfer_incomplete": 503, "kv_integrity_error": 500}
        assert r.status_code == want.get(code), r.text
        assert (r.headers.get("retry-after") is not None) == (r.status_code == 503), r.headers
        assert not leaked(r.text, canaries)
        assert up.pages_used("prefill") == 0 and up.pages_used("decode") == 0
    finally:
        up.stop()


def test_incident_twin_placeholder_with_guards_off_leaks_a_canary(tmp_path: Path) -> None:
    # The twin: proves the canary check above can fail. This is the report's 155 answers.
    # One ask is enough: with fixed canaries the answer is the same whichever pages B gets.
    up, canaries, r, _, _ = run_incident(tmp_path, f"placeholder_on_reject,{GUARDS_OFF}")
    try:
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["text"]
        assert leaked(answer, canaries), f"no canary of tenant A in B's answer: {answer!r}"
    finally:
        up.stop()
