"""The prefix cache across PD on 2 prefills + 2 decodes placed by the cache-aware router's own
policy (in-process: the router's Routing and prefix index, real engines, real TCP or Mooncake
between them): multi-turn chats of two tenants token-exact against unified and transformers,
each turn routed to the decode (and prefill) that served the tenant's previous turn and sending
only the pages that decode lacks, forced eviction in the middle, pools and references back to
baseline on all four workers; a tenant's identical opening never attracts another tenant's
request (I6, with its twin). The 1P1D guards and their twins are in test_pd_prefix.py."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, random_prompts
from pd_harness import PDCluster, Result, finished_ok

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.server.router.policy import Pair, Reason

CTX = 256
PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TENANTS = ("A", "B")


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir) -> str:
    return str(checkpoint_dir("llama"))


@pytest.fixture(scope="module", params=["tcp", "mooncake"])
def cluster(request, model_dir: str):
    if request.param == "mooncake":
        from kvfence.pd.transport import mooncake

        if not mooncake.available():
            pytest.skip("mooncake transfer engine not installed (pip install 'kvfence[mooncake]')")
    c = PDCluster(model_dir, 2, 2, request.param, kv_pool_tokens=1024, context_length=CTX,
                  chunked_prefill_size=64)  # fmt: skip
    yield c
    c.close()


@pytest.fixture(scope="module")
def unified(model_dir: str) -> LLM:
    return LLM(model_dir, kv_pool_tokens=1024, context_length=CTX)


def flush(cluster: PDCluster) -> None:
    """Forced eviction on every worker, once nothing is in flight."""
    assert cluster.wait_idle(), f"pages still used: {cluster.pages_used()}"
    for svc in cluster.services:
        svc.engine.pool.evict_unreferenced()


def assert_baseline(cluster: PDCluster) -> None:
    assert cluster.wait_idle(), f"pages still used: {cluster.pages_used()}"
    for svc in cluster.services:
        prefix = svc.engine.pool.prefix
        assert prefix is not None and prefix.num_holders == 0
        assert prefix.num_evictable == prefix.num_cached  # no reference left anywhere


def bytes_sent(cluster: PDCluster) -> int:
    return sum(svc.transfer_stats.get("bytes_sent") for svc in cluster.prefills)


def where(cluster: PDCluster, pair: Pair) -> tuple[int, int]:
    """(decode index, prefill index) the router picked."""
    r = cluster.routing
    return (r.decode.workers.index(pair.decode.worker),
            r.prefill.workers.index(pair.prefill.worker))  # fmt: skip


def test_2p2d_multi_turn_two_tenants_follow_their_kv_and_stay_exact(
    cluster: PDCluster, unified: LLM, model_dir: str
) -> None:
    flush(cluster)
    opening = random_prompts([40], vocab=256, seed=41)[0]  # both tenants' identical first turn
    users = {t: random_prompts([9, 12, 7], vocab=256, seed=42 + i) for i, t in enumerate(TENANTS)}
    history = {t: list(opening) for t in TENANTS}
    FLUSHED = 2  # forced eviction before this turn: it starts cold on the decode it returns to
    rows: list[dict] = []
    for turn in range(4):
        if turn == FLUSHED:
            flush(cluster)
        for t in TENANTS:
            prompt = history[t] + (users[t][turn - 1] if turn else [])
            before = bytes_sent(cluster)
            pair, r = cluster.ask(prompt, GREEDY, t)
            assert isinstance(r, Result) and finished_ok(r), r.final
            rows.append({"turn": turn, "tenant": t, "prompt": prompt, "got": r.token_ids,
                         "cached": r.final.cached_tokens, "sent": bytes_sent(cluster) - before,
                         "at": where(cluster, pair), "pair": pair})  # fmt: skip
            history[t] = prompt + r.token_ids
    prompts = [row["prompt"] for row in rows]
    want = [o.token_ids for o in unified.generate(prompts, GREEDY)]
    assert [row["got"] for row in rows] == want == hf_greedy(model_dir, prompts, GREEDY.max_tokens)

    first = {row["tenant"]: row for row in rows if row["turn"] == 0}
    # I6: B's opening is A's, yet nothing of A's moved B's placement: no prediction, by load.
    b0 = first["B"]["pair"]
    assert (b0.decode.reason, b0.prefill.reason) == (Reason.FALLBACK, Reason.FALLBACK)
    assert b0.decode.predicted_tokens == b0.prefill.predicted_tokens == 0
    # Both decodes and both prefills served (the two chats were spread by load).
    assert {row["at"] for row in rows} == {first["A"]["at"], first["B"]["at"]}
    assert first["A"]["at"][0] != first["B"]["at"][0] and first["A"]["at"][1] != first["B"]["at"][1]
    per_token = first["A"]["sent"] // len(opening)  # a page's KV travels for its filled slots
    for row in rows:
        t, turn, n = row["tenant"], row["turn"], len(row["prompt"])
        if turn:
            # Turn k+1 goes where turn k went, because the router predicts the tenant's prefix.
            assert row["at"] == first[t]["at"], (t, turn, row["at"])
            assert (row["pair"].decode.reason, row["pair"].prefill.reason) == (
                Reason.CACHE_HIT, Reason.CACHE_HIT)  # fmt: skip
            assert row["pair"].decode.predicted_tokens > 0
        # Decode holds the previous turn's prompt and answer pages (but the last token), except
        # on a tenant's first turn and right after the forced eviction.
        prev = len(history_before(rows, row)) + GREEDY.max_tokens - 1 if turn else 0
        expected = 0 if turn in (0, FLUSHED) else prev // PAGE * PAGE
        assert row["cached"] == expected, (t, turn, row["cached"], expected)
        # Bytes per turn are the tokens decode lacks, however long the history.
        assert row["sent"] == (n - row["cached"]) * per_token, (t, turn, row["sent"])
    assert_baseline(cluster)


def history_before(rows: list[dict], row: dict) -> list[int]:
    """The prompt of the same tenant's previous turn."""
    prev = [r for r in rows if r["tenant"] == row["tenant"] and r["turn"] == row["turn"] - 1]
    return prev[0]["prompt"]


def _identical_openings(cluster: PDCluster) -> tuple[Pair, Pair]:
    flush(cluster)
    prompt = random_prompts([48], vocab=256, seed=47)[0]
    a, ra = cluster.ask(prompt, GREEDY, "C")
    b, rb = cluster.ask(prompt, GREEDY, "D")
    assert finished_ok(ra) and finished_ok(rb) and ra.token_ids == rb.token_ids
    assert rb.final.cached_tokens == 0  # the workers never share C's pages with D either
    assert_baseline(cluster)
    return a, b


def test_i6_2p2d_another_tenants_identical_prompt_does_not_move_the_route(
    cluster: PDCluster,
) -> None:
    _, b = _identical_openings(cluster)
    assert (b.decode.reason, b.prefill.reason) == (Reason.FALLBACK, Reason.FALLBACK)


def test_i6_twin_2p2d_an_index_ignoring_the_tenant_routes_d_after_c(cluster: PDCluster) -> None:
    with cluster.faults.injected("router_ignore_tenant"):
        a, b = _identical_openings(cluster)
    assert (b.decode.reason, b.prefill.reason) == (Reason.CACHE_HIT, Reason.CACHE_HIT)
    assert (b.decode.worker, b.prefill.worker) == (a.decode.worker, a.prefill.worker)
