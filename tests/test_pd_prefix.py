"""The prefix cache across PD, on an in-process 1P1D pair with both caches on: multi-turn chats
of two tenants token-exact against unified and transformers, turn k+1 reusing turn k's KV on
decode (fewer bytes sent), forced eviction between turns, pools and references back to
baseline; no page shared across tenants on either role; a cached prefix the two roles disagree
on, or one that changed under a room, fails closed (with twins)."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, random_prompts
from pd_harness import PDPair, Result, finished_ok
from waiting import wait_for

from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.kv.prefix import PageKeyer

CTX = 256
PAGE = 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir) -> str:
    return str(checkpoint_dir("llama"))


@pytest.fixture(scope="module")
def pair(model_dir: str):
    pd = PDPair(model_dir, kv_pool_tokens=1024, context_length=CTX, chunked_prefill_size=64)
    yield pd
    pd.close()


@pytest.fixture(scope="module")
def unified(model_dir: str) -> LLM:
    return LLM(model_dir, kv_pool_tokens=1024, context_length=CTX)


def ask(pair: PDPair, prompt: list[int], tenant: str) -> Result:
    _, r = pair.submit(prompt, GREEDY, tenant)
    assert isinstance(r, Result), r
    assert r.done.wait(60), "request did not finish"
    return r


def flush(pair: PDPair) -> None:
    """Forced eviction on both roles, once nothing is in flight (the engines are idle)."""
    assert pair.wait_idle(), "the pair did not go idle"
    for svc in (pair.prefill, pair.decode):
        svc.engine.pool.evict_unreferenced()


def assert_baseline(pair: PDPair) -> None:
    assert pair.wait_idle(), f"pages still used: {pair.pages_used()}"
    for svc in (pair.prefill, pair.decode):
        prefix = svc.engine.pool.prefix
        assert prefix is not None and prefix.num_holders == 0
        assert prefix.num_evictable == prefix.num_cached  # no reference left anywhere


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_pd_multi_turn_two_tenants_reuses_decode_kv_and_stays_exact(
    backend: str, pair: PDPair, unified: LLM, model_dir: str
) -> None:
    if backend == "tcp":
        multi_turn(pair, unified, model_dir)
        return
    from kvfence.pd.transport import mooncake

    if not mooncake.available():
        pytest.skip("mooncake transfer engine not installed (pip install 'kvfence[mooncake]')")
    pd = PDPair(
        model_dir,
        backend="mooncake",
        kv_pool_tokens=1024,
        context_length=CTX,
        chunked_prefill_size=64,
    )
    try:
        multi_turn(pd, unified, model_dir)
    finally:
        pd.close()


def multi_turn(pair: PDPair, unified: LLM, model_dir: str) -> None:
    flush(pair)
    stats, sender = pair.decode.transfer_stats, pair.prefill.transfer_stats
    # Both tenants open with the same system prompt: identical first turns.
    opening = random_prompts([40], vocab=256, seed=5)[0]
    users = random_prompts([9, 12, 7, 11], vocab=256, seed=6)
    history = {"A": list(opening), "B": list(opening)}
    prompts, got, cached, sent = [], [], [], []
    for turn in range(3):
        if turn == 2:
            flush(pair)  # forced eviction mid-conversation: the next turn starts cold
        for t, tenant in enumerate(("A", "B")):
            prompt = history[tenant] + (users[2 * t + turn % 2] if turn else [])
            before = sender.get("bytes_sent")
            r = ask(pair, prompt, tenant)
            assert finished_ok(r), r.final
            prompts.append(prompt)
            got.append(r.token_ids)
            cached.append(r.final.cached_tokens)
            sent.append(sender.get("bytes_sent") - before)
            history[tenant] = prompt + r.token_ids
    want = [o.token_ids for o in unified.generate(prompts, GREEDY)]
    assert got == want == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    # Turn 1: nothing cached (B's identical opening is A's, another namespace). Turn 2 reuses
    # turn 1's prompt and answer pages on decode, so less travels; turn 3 follows a flush.
    assert cached[:2] == [0, 0]
    for i in (2, 3):
        assert cached[i] == (len(prompts[i - 2]) + GREEDY.max_tokens - 1) // PAGE * PAGE
        # A longer prompt, yet fewer bytes than turn 1: only what decode lacks travels.
        assert len(prompts[i]) > len(prompts[i - 2]) and 0 < sent[i] < sent[i - 2]
        assert sent[i + 2] > sent[i]  # after the flush, the whole (longer) prompt travels
    assert cached[4:] == [0, 0]
    assert stats.get("prefix_cached_tokens") >= cached[2] + cached[3]
    assert stats.get("bytes_not_transferred") > 0
    # Each worker's /metrics: its own hit rate (prefill computed less too), bytes not sent.
    for svc in (pair.prefill, pair.decode):
        metrics = {m.name: m.samples[0].value for m in svc.metrics()}
        assert 0 < metrics["kvfence_pd_prefix_hit_rate"] < 1
        assert metrics["kvfence_pd_bytes_not_transferred"] > 0
    assert_baseline(pair)


def _tenants_share(pair: PDPair) -> tuple[int, set[int]]:
    """Identical prompts from tenants C and D: decode's cached tokens for D, and the pages any
    holder of C's and D's chains shares on either role (read from the caches' own tables)."""
    flush(pair)
    prompt = random_prompts([50], vocab=256, seed=9)[0]
    c = ask(pair, prompt, "C")
    d = ask(pair, prompt, "D")
    again = ask(pair, prompt, "D")  # D's second ask hits D's own pages
    assert all(finished_ok(r) for r in (c, d, again))
    assert c.token_ids == d.token_ids == again.token_ids
    assert again.final.cached_tokens > 0
    owners = [_cached_by_tenant(pair.prefill), _cached_by_tenant(pair.decode)]
    return d.final.cached_tokens, owners


def _cached_by_tenant(svc) -> dict[str, set[int]]:
    """The role's cached pages by the tenant whose namespace sealed them (the cache's tables)."""
    prefix = svc.engine.pool.prefix
    out: dict[str, set[int]] = {}
    for page in range(1, svc.engine.pool.num_pages + 1):
        e = prefix.entry(page)
        if e is not None:
            out.setdefault(e.namespace.tenant or "", set()).add(page)
    return out


def test_pd_identical_prompts_of_two_tenants_never_share_a_page(pair: PDPair) -> None:
    d_cached, owners = _tenants_share(pair)
    assert d_cached == 0, "tenant D's first ask reused tenant C's KV"
    for role in owners:
        # Each tenant holds its own copy, in its own namespace, on both roles.
        assert role.get("C") and role.get("D") and not role["C"] & role["D"]
    assert_baseline(pair)


def test_pd_twin_ignoring_the_namespace_tenant_d_attends_to_c_pages(pair: PDPair) -> None:
    with pair.faults.injected("prefix_cache_ignore_namespace"):
        d_cached, owners = _tenants_share(pair)
    flush(pair)
    assert d_cached > 0, "the twin should let D's first ask reuse C's cached KV"
    assert not any(role.get("D") for role in owners), "D held no page of its own"


class CollidingKeyer(PageKeyer):
    """A forced hash collision: a page's key ignores its tokens."""

    def key(self, ns, parent, tokens):
        return super().key(ns, parent, [len(tokens)])


def _disagreeing_prefix(pair: PDPair, unified: LLM, guard_off: bool) -> Result:
    """Decode's cache (key collision + token compare skipped) holds X's pages under Y's keys:
    its RESERVE claims a prefix that is not Y's. Prefill's recomputed prefix digest refuses the
    room; with that check skipped, decode attends to X's KV for Y."""
    flush(pair)
    prefix = pair.decode.engine.pool.prefix
    keyer, prefix.keyer = prefix.keyer, CollidingKeyer()
    x, y = random_prompts([40, 40], vocab=256, seed=13)
    try:
        assert finished_ok(ask(pair, x, "A"))
        points = ["prefix_cache_skip_token_compare"] + (["skip_prefix_digest"] if guard_off else [])
        with pair.faults.injected(*points):
            r = ask(pair, y, "A")
    finally:
        flush(pair)
        prefix.keyer = keyer
    assert_baseline(pair)
    want = unified.generate([y], GREEDY)[0].token_ids
    if guard_off:
        assert finished_ok(r) and r.token_ids != want, "the twin should commit X's KV for Y"
    else:
        assert r.final.finish_reason is FinishReason.ERROR
        assert r.final.error_code == "kv_prefix_mismatch" and r.final.error_status == 500
        assert pair.prefill.transfer_stats.get("prefix_mismatches") > 0
    return r


def test_pd_prefix_disagreement_aborts_the_room_fail_closed(pair: PDPair, unified: LLM) -> None:
    _disagreeing_prefix(pair, unified, guard_off=False)


def test_pd_twin_skipping_the_prefix_digest_commits_another_prompts_kv(
    pair: PDPair, unified: LLM
) -> None:
    _disagreeing_prefix(pair, unified, guard_off=True)


def _stale_cached_page(
    pair: PDPair, unified: LLM, guard_off: bool, batched: bool = False
) -> Result:
    """A decode cache page changes under a room after its RESERVE: the read-back before commit
    covers the cached prefix too and refuses; without checksums the wrong KV is committed.
    batched: the read-back a GPU pool takes (one gather on the device, one sync)."""
    flush(pair)
    pair.decode.pool_port.batched_checksums = batched
    first = random_prompts([40], vocab=256, seed=17)[0]
    assert finished_ok(ask(pair, first, "A"))
    second = first + random_prompts([5], vocab=256, seed=18)[0]
    points = ["stale_cached_page"] + (["skip_checksum"] if guard_off else [])
    with pair.faults.injected(*points):
        r = ask(pair, second, "A")
    flush(pair)  # the corrupted page must not serve anyone after this test
    assert_baseline(pair)
    assert r.final.cached_tokens > 0 or r.final.finish_reason is FinishReason.ERROR
    want = unified.generate([second], GREEDY)[0].token_ids
    if guard_off:
        assert finished_ok(r) and r.token_ids != want, "the twin should commit the stale page"
    else:
        assert r.final.finish_reason is FinishReason.ERROR
        assert r.final.error_code == "kv_transfer_incomplete"
    return r


def test_i3_pd_cached_prefix_changed_under_the_room_fails_closed(
    pair: PDPair, unified: LLM
) -> None:
    _stale_cached_page(pair, unified, guard_off=False)


def test_i3_twin_without_checksums_the_stale_cached_page_is_committed(
    pair: PDPair, unified: LLM
) -> None:
    _stale_cached_page(pair, unified, guard_off=True)


def test_i3_batched_read_back_catches_the_stale_cached_page(pair: PDPair, unified: LLM) -> None:
    try:
        _stale_cached_page(pair, unified, guard_off=False, batched=True)
    finally:
        pair.decode.pool_port.batched_checksums = False


def test_i3_twin_without_checksums_the_batched_read_back_commits_the_stale_page(
    pair: PDPair, unified: LLM
) -> None:
    try:
        _stale_cached_page(pair, unified, guard_off=True, batched=True)
    finally:
        pair.decode.pool_port.batched_checksums = False


def test_pd_eviction_racing_a_transfer_never_takes_a_pinned_page(
    pair: PDPair, unified: LLM
) -> None:
    """Forced eviction on decode while a room that references cached pages is in flight: the
    room's pages stay cached (pinned by its reference), and the answer stays exact."""
    flush(pair)
    first = random_prompts([40], vocab=256, seed=23)[0]
    assert finished_ok(ask(pair, first, "A"))
    second = first + random_prompts([6], vocab=256, seed=24)[0]
    stall, pair.faults.stall_s = pair.faults.stall_s, 0.5
    try:
        with pair.faults.injected("stall_transfer"):
            _, r = pair.submit(second, GREEDY, "A")
            assert isinstance(r, Result), r
            wait_for(lambda: pair.decode.rooms, 10, "decode never opened the room")
            room = next(iter(pair.decode.rooms.values()))
            held = room.pages[: room.cached]
            prefix = pair.decode.engine.pool.prefix
            evicted = pair.decode.engine.pool.evict_unreferenced()  # the engine is idle
            assert held and all(prefix.is_cached(pg) for pg in held), (evicted, held)
            assert r.done.wait(60), "request did not finish"
    finally:
        pair.faults.stall_s = stall
    assert finished_ok(r) and r.final.cached_tokens == len(held) * PAGE
    assert r.token_ids == unified.generate([second], GREEDY)[0].token_ids
    assert_baseline(pair)
