"""`kvfence up` end to end with the bundled model: router + prefill + decode processes over TCP
(and Mooncake when installed) answer token-exact with the unified engine and transformers, serve
two tenants concurrently, and reject over-length prompts before any page or transfer exists.
Opt-in (RUN_SLOW=1): two tenants' multi-turn chats through a 2P2D cluster with caches on and the
cache-aware router, token-exact, each later turn served from its decode's cache (the in-process
version with forced eviction runs in CI: test_pd_prefix_2p2d.py), and a 1P1D cluster with
--tp-size 2 on both sides (in-process version in CI: test_pd_tp.py)."""

from __future__ import annotations

import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import TINY_MODEL, hf_greedy, random_prompts
from waiting import wait_for

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.tools.cluster import LocalCluster

CTX = 512
KEYS = {"key-alpha": "alpha", "key-beta": "beta"}


class Cluster(LocalCluster):
    def __init__(self, tmp: Path, backend: str, prefill: int, decode: int, *extra: str) -> None:
        super().__init__(
            tmp,
            TINY_MODEL,
            "--prefill",
            str(prefill),
            "--decode",
            str(decode),
            "--context-length",
            str(CTX),
            "--kv-pool-tokens",
            "4096",
            "--disaggregation-transfer-backend",
            backend,
            *extra,
            keys=KEYS,
        )

    def post(self, body: dict, key: str = "key-alpha") -> httpx.Response:  # type: ignore[override]
        return super().post(body, key)

    def turn(self, prompt: list[int], key: str = "key-alpha") -> tuple[list[int], int]:
        """One greedy 6-token answer as token ids, and the prompt tokens served from cache."""
        r = self.post({"model": "kvfence-tiny", "prompt": prompt, "max_tokens": 6,
                       "temperature": 0, "ignore_eos": True, "logprobs": 0,
                       "return_tokens_as_token_ids": True}, key)  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        tokens = body["choices"][0]["logprobs"]["tokens"]
        answer = [int(t.removeprefix("token_id:")) for t in tokens]
        return answer, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def backend_or_skip(backend: str) -> None:
    if backend == "mooncake":
        from kvfence.pd.transport import mooncake

        if not mooncake.available():
            pytest.skip("mooncake transfer engine not installed")


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_up_1p1d_greedy_equals_unified_and_transformers(backend: str, tmp_path: Path) -> None:
    backend_or_skip(backend)
    lengths = [1, 15, 16, 17, CTX - 8]
    prompts = random_prompts(lengths, vocab=2048, seed=31)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    unified = LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=CTX).generate(
        prompts, params
    )
    hf = hf_greedy(TINY_MODEL, prompts, 8)
    cluster = Cluster(tmp_path, backend, 1, 1)
    try:
        for n, prompt, u, h in zip(lengths, prompts, unified, hf, strict=True):
            r = cluster.post(
                {
                    "model": "kvfence-tiny",
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                }
            )
            assert r.status_code == 200, r.text
            tokens = r.json()["choices"][0]["logprobs"]["tokens"]
            got = [int(t.removeprefix("token_id:")) for t in tokens]
            assert got == u.token_ids == h, f"prompt of {n} tokens"
        wait_for(lambda: cluster.pages_used() == [0, 0], 15,
                 lambda: f"pages still used: {cluster.pages_used()}", interval=0.1)
    finally:
        cluster.stop()


def test_up_2p2d_two_tenants_40_concurrent_and_over_length(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, "tcp", 2, 2)
    try:
        values = [secrets.token_hex(7) for _ in range(40)]

        def ask(i: int) -> tuple[int, str]:
            filler = "The river ran slow past the mill. " * (3 + i % 5)
            prompt = f"{filler}\nsecret: {values[i]}\n{filler}\nsecret:"
            key = "key-alpha" if i % 2 else "key-beta"
            r = cluster.post(
                {
                    "model": "kvfence-tiny",
                    "prompt": prompt,
                    "max_tokens": 16,
                    "temperature": 0,
                    "stop": "\n",
                },
                key,
            )
            return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, range(40)))
        for i, (status, text) in enumerate(answers):
            assert status == 200, text
            assert text.strip() == values[i], f"request {i} got {text!r}"
            others = [v for j, v in enumerate(values) if j != i]
            assert not any(v in text for v in others), "another request's secret leaked"
        wait_for(lambda: cluster.pages_used() == [0, 0, 0, 0], 15,
                 lambda: f"pages still used: {cluster.pages_used()}", interval=0.1)

        # The incident's path: an over-length prompt through PD gets the admission reason.
        r = cluster.post({"model": "kvfence-tiny", "prompt": [7] * (CTX + 1), "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        before = {
            w["url"]: httpx.get(f"{w['url']}/pd/info", headers=cluster.operator).json()["counters"]
            for w in cluster.workers()
        }
        r = cluster.post({"model": "kvfence-tiny", "prompt": [7] * 2000, "max_tokens": 4})
        assert r.status_code == 400
        after = {
            w["url"]: httpx.get(f"{w['url']}/pd/info", headers=cluster.operator).json()["counters"]
            for w in cluster.workers()
        }
        assert before == after, "a rejected request reserved pages or started a transfer"
        assert cluster.pages_used() == [0, 0, 0, 0]
        r = cluster.post({"model": "kvfence-tiny", "prompt": "hi", "max_tokens": 2}, "wrong-key")
        assert r.status_code == 401
    finally:
        cluster.stop()


@pytest.mark.skipif(os.environ.get("RUN_SLOW") != "1", reason="slow (a 2P2D cluster): RUN_SLOW=1")
@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_up_2p2d_multi_turn_two_tenants_hit_their_decode_cache_and_stay_exact(
    backend: str, tmp_path: Path
) -> None:
    backend_or_skip(backend)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    opening = random_prompts([40], vocab=2048, seed=51)[0]  # both tenants' identical first turn
    users = {k: random_prompts([9, 12], vocab=2048, seed=52 + i) for i, k in enumerate(KEYS)}
    history = {k: list(opening) for k in KEYS}
    cluster = Cluster(tmp_path, backend, 2, 2)
    prompts, got, cached = [], [], []
    try:
        for turn in range(3):
            for key in KEYS:
                prompt = history[key] + (users[key][turn - 1] if turn else [])
                answer, hit = cluster.turn(prompt, key)
                prompts.append(prompt)
                got.append(answer)
                cached.append(hit)
                history[key] = prompt + answer
        wait_for(lambda: cluster.pages_used() == [0, 0, 0, 0], 15,
                 lambda: f"pages still used: {cluster.pages_used()}", interval=0.1)
        metrics = httpx.get(f"{cluster.url}/metrics", headers=cluster.operator, timeout=5).text
    finally:
        cluster.stop()
    unified = LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=CTX)
    want = [o.token_ids for o in unified.generate(prompts, params)]
    assert got == want == hf_greedy(TINY_MODEL, prompts, 6)
    # First turns: nothing cached (B's identical opening is A's, another tenant). Later turns:
    # the router sent each back to its decode, which holds the previous prompt and answer.
    assert cached[:2] == [0, 0] and all(c >= 32 for c in cached[2:]), cached
    hits = 'kvfence_router_decisions_total{policy="cache_aware",reason="cache_hit",role="decode"}'
    assert f"{hits} 4.0" in metrics, metrics


@pytest.mark.skipif(os.environ.get("RUN_SLOW") != "1", reason="slow (4 processes): RUN_SLOW=1")
def test_up_1p1d_tp2_token_exact_and_the_second_turn_hits_decode_cache(tmp_path: Path) -> None:
    """`kvfence up --tp-size 2`: prefill and decode each one server process and one child rank
    (the bundled model has one KV head: each rank holds it whole, replicated). Run:
    `RUN_SLOW=1 .venv/bin/python -m pytest tests/test_up_e2e.py -k tp2`."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = random_prompts([40], vocab=2048, seed=61)[0]
    cluster = Cluster(tmp_path, "tcp", 1, 1, "--tp-size", "2")
    prompts, got, cached = [], [], []
    try:
        prompt = first
        for _ in range(2):
            answer, hit = cluster.turn(prompt)
            prompts.append(prompt)
            got.append(answer)
            cached.append(hit)
            prompt = prompt + answer + [5, 6, 7]
        wait_for(lambda: cluster.pages_used() == [0, 0], 15,
                 lambda: f"pages still used: {cluster.pages_used()}", interval=0.1)
    finally:
        cluster.stop()
    unified = LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=CTX)
    assert got == [o.token_ids for o in unified.generate(prompts, params)]
    assert got == hf_greedy(TINY_MODEL, prompts, 6)
    assert cached[0] == 0 and cached[1] >= 32, cached
