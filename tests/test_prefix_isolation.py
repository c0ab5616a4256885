"""The prefix cache never crosses tenants (I2, I6): identical prompts of two tenants share
nothing (cached_tokens 0 across, > 0 within), equal cache_salts of two tenants never match, only
declared public prefixes are shared; sealed pages are read only by rows whose namespace and key
match and are never written. Each guard has a twin that leaks or corrupts with it off, on the
bundled recall model (models/kvfence-tiny), which copies whatever its KV holds."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import TINY_MODEL, random_prompts
from fastapi.testclient import TestClient
from prefix_harness import Ask, assert_baseline, run_waves

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.faults import Faults
from kvfence.kv.pool import KVPool, SealedReads
from kvfence.kv.prefix import SHARED, Namespace, PageKeyer, PrefixCache, SharedPrefixes
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.server.operator import new_operator_key, operator_headers
from kvfence.tools.canary import ALPHABET

PAGE = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
RECALL = SamplingParams(max_tokens=12, temperature=0.0, stop=("\n",))


def canary(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(12))


def leaked(text: str, secret: str) -> bool:
    return any(secret[i : i + 8] in text for i in range(len(secret) - 7))


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=1024)


def ask(engine: Engine, rid: str, text: str, tenant: str, salt: str | None = None):
    ids = engine.tokenizer.encode(text)
    return run_waves(engine, [[Ask(rid, ids, tenant, salt)]], RECALL)[rid]


# ---- tenants and salts -----------------------------------------------------------------------


def test_identical_prompts_of_two_tenants_share_nothing(checkpoint_dir) -> None:
    llm = LLM(str(checkpoint_dir("llama")), kv_pool_tokens=1024, context_length=128)
    [p] = random_prompts([60], 256, seed=3)
    got = run_waves(
        llm.engine,
        [[Ask("a1", p, "A")], [Ask("b1", p, "B")], [Ask("a2", p, "A")], [Ask("b2", p, "B")]],
        GREEDY,
        gap=40,  # each finishes before the next arrives
    )
    assert got["a1"].cached == 0 and got["b1"].cached == 0  # B never reads A's pages
    assert got["a2"].cached == 3 * PAGE and got["b2"].cached == 3 * PAGE  # each its own
    assert len({tuple(a.tokens) for a in got.values()}) == 1
    assert_baseline(llm.engine)


def test_cache_salt_narrows_within_a_tenant_and_never_matches_across(checkpoint_dir) -> None:
    llm = LLM(str(checkpoint_dir("llama")), kv_pool_tokens=1024, context_length=128)
    [p] = random_prompts([60], 256, seed=4)
    order = [
        ("a_s", "A", "s"),
        ("b_s", "B", "s"),  # the same salt in another tenant: a different namespace
        ("a_none", "A", None),  # no salt: A's unsalted namespace, not the salted one
        ("a_other", "A", "other"),
        ("a_s2", "A", "s"),
        ("b_s2", "B", "s"),
    ]
    got = run_waves(llm.engine, [[Ask(r, p, t, s)] for r, t, s in order], GREEDY, gap=40)
    assert [got[r].cached for r, _, _ in order] == [0, 0, 0, 0, 48, 48]
    assert_baseline(llm.engine)


def test_declared_shared_prefix_is_the_only_thing_shared(checkpoint_dir, tmp_path) -> None:
    [system, tail_a, tail_b] = random_prompts([40, 20, 20], 256, seed=5)
    f = tmp_path / "shared.json"
    f.write_text(json.dumps([system]))
    llm = LLM(
        str(checkpoint_dir("llama")),
        kv_pool_tokens=1024,
        context_length=128,
        shared_prefix_file=str(f),
    )
    got = run_waves(
        llm.engine,
        [
            [Ask("a", system + tail_a, "A")],
            [Ask("b", system + tail_a, "B")],  # same tail: still only the public pages
            [Ask("b2", system + tail_b, "B", "salted")],
        ],
        GREEDY,
        gap=40,
    )
    # 40 public tokens: pages 0 and 1 lie inside; page 2 leaves it (tenant's own namespace).
    assert [got[r].cached for r in ("a", "b", "b2")] == [0, 2 * PAGE, 2 * PAGE]
    assert_baseline(llm.engine)


def test_usage_reports_cached_tokens_and_metrics_have_no_tenant(checkpoint_dir) -> None:
    cfg = EngineConfig(
        model=str(checkpoint_dir("llama")),
        kv_pool_tokens=1024,
        context_length=128,
        served_model_name="tiny",
    )
    engine = Engine(cfg)
    engine.start()
    keys = {"sk-a": "A", "sk-b": "B"}
    try:
        operator_key = new_operator_key()
        app = build_app(UnifiedService(engine), api_keys=keys, operator_key=operator_key)
        with TestClient(app) as client:
            [p] = random_prompts([60], 256, seed=6)
            body = {"model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0}

            def cached(key: str, stream: bool = False, salt: str | None = None) -> int:
                b = dict(body, stream=stream, cache_salt=salt)
                if stream:
                    b["stream_options"] = {"include_usage": True}
                r = client.post(
                    "/v1/completions", json=b, headers={"Authorization": f"Bearer {key}"}
                )
                assert r.status_code == 200, r.text
                if not stream:
                    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: {")]
                return json.loads(events[-1])["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert cached("sk-a") == 0
            assert cached("sk-b") == 0
            assert cached("sk-a", stream=True) == 48
            assert cached("sk-b") == 48
            assert cached("sk-b", salt="x") == 0
            r = client.post(
                "/v1/completions",
                json=dict(body, cache_salt=""),
                headers={"Authorization": "Bearer sk-a"},
            )
            assert r.status_code == 400
            metrics = client.get("/metrics", headers=operator_headers(operator_key)).text
        hits = [x for x in metrics.splitlines() if x.startswith("kvfence_prefix_cache")]
        assert any(x.startswith("kvfence_prefix_cache_hits_total 96.0") for x in hits), hits
        assert all("tenant" not in x for x in hits)
    finally:
        engine.shutdown()


# ---- I2 for sealed pages, in the pool ---------------------------------------------------------


def pool_with_cache() -> tuple[KVPool, PrefixCache]:
    cache = PrefixCache(4, shared=SharedPrefixes([[9, 9, 9, 9]], 4), faults=Faults())
    pool = KVPool(
        num_layers=1,
        num_pages=8,
        page_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
        prefix=cache,
    )
    return pool, cache


def test_i2_sealed_pages_are_read_only_and_namespaced() -> None:
    pool, cache = pool_with_cache()
    tokens = [9, 9, 9, 9, 1, 2, 3, 4, 5]
    ga = pool.new_grant("A", "a")
    chain_a = cache.chain(tokens, Namespace.of_tenant("A"))
    pages = pool.allocate(ga, 3)
    pool.mark_written(ga, pages[:2])
    assert pool.seal(ga, chain_a, 0, pages[:2], tokens) == 2
    assert chain_a.namespaces == [SHARED, Namespace.of_tenant("A")]
    # A sealed page is no grant's: it cannot be freed, nor sealed twice.
    gb = pool.new_grant("B", "b")
    chain_b = cache.chain(tokens, Namespace.of_tenant("B"))

    def bad(grant, chain, row_pages, read_only_cols) -> bool:
        table = torch.tensor([row_pages])
        cols = torch.arange(len(row_pages))[None, :]
        tags = list(chain.tags) + [0] * (len(row_pages) - len(chain.tags))
        reads = SealedReads(
            read_only=cols < read_only_cols,
            ns_ids=torch.tensor([cache.namespace_id(chain.tenant_ns)]),
            key_tags=torch.tensor([tags]),
        )
        return bool(
            pool.check_owned(
                table,
                torch.tensor([grant.grant_id]),
                torch.tensor([grant.tenant_id]),
                torch.ones_like(table, dtype=torch.bool),
                cols < read_only_cols,
                reads,
            )[0]
        )

    own_b = pool.allocate(gb, 1)
    assert not bad(ga, chain_a, pages, 2)  # A reads its sealed pages, owns the third
    assert bad(ga, chain_a, pages, 3)  # ... but cannot read its third before writing it
    assert bad(ga, chain_a, pages[:2] + [pages[1]], 2)  # a write to a sealed page fails
    assert not bad(gb, chain_b, [pages[0]] + own_b, 1)  # the public page: anyone
    assert bad(gb, chain_b, pages[:2] + own_b, 2)  # A's own page: never B
    # Same namespace, wrong place: the key of page 1 is not the key a row expects at 0.
    assert bad(ga, chain_a, [pages[1], pages[1]] + pages[2:], 2)
    # Twin: without the namespace compare and with B's keys made equal to A's, B reads it.
    with cache.faults.injected("prefix_cache_ignore_namespace"):
        chain_b_blind = cache.chain(tokens, Namespace.of_tenant("B"))
        chain_a_blind = cache.chain(tokens, Namespace.of_tenant("A"))
        assert chain_b_blind.tags == chain_a_blind.tags
    pool.release_prefix(ga)
    pool.free(ga, [pages[2]])
    pool.free(gb, own_b)
    assert pool.num_free == pool.num_pages and cache.num_evictable == 2
    assert len(pool.allocate(pool.new_grant("C", "c"), 8)) == 8  # evicted to make room
    assert cache.num_cached == 0


# ---- the three twins on the recall model ------------------------------------------------------


def template(pin: str) -> str:
    """A form whose layout is public and whose pin is tenant A's secret."""
    return (
        "form: account recovery\nuser: alice\nregion: north\n"
        f"pin: {pin}\nnote: keep this safe\nstatus: open\nowner:"
    )


def probe(engine: Engine, secret_of_a: str, rng: random.Random) -> str | None:
    """Tenant B's attack on its own answers: the candidate whose probe reused the most cached
    tokens, if it stands out; the true pin is not the first candidate tried."""
    candidates = [canary(rng) for _ in range(5)]
    candidates.insert(2, secret_of_a)
    cached = {c: ask(engine, f"b-{c}", template(c), "B").cached for c in candidates}
    best = max(cached.values())
    winners = [c for c, n in cached.items() if n == best]
    return winners[0] if len(winners) == 1 else None


def _pin_probe(guard_off: bool) -> None:
    llm = LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=1024)
    rng = random.Random(7)
    pin = canary(rng)
    if guard_off:
        llm.engine.faults.arm("prefix_cache_ignore_namespace")
    a = ask(llm.engine, "a", template(pin), "A")
    assert a.finish is not None and a.error_code is None
    recovered = probe(llm.engine, pin, rng)
    llm.engine.faults.disarm("prefix_cache_ignore_namespace")
    if guard_off:
        assert recovered == pin, "with the namespace ignored, B's answers give A's pin away"
    else:
        assert recovered is None
    assert_baseline(llm.engine)


def test_tenant_b_cannot_recover_a_pin_through_the_cache() -> None:
    _pin_probe(guard_off=False)


def test_twin_ignoring_the_namespace_b_recovers_a_pin() -> None:
    _pin_probe(guard_off=True)


class CollidingKeyer(PageKeyer):
    """A forced hash collision: a page's key ignores its tokens."""

    def key(self, ns, parent, tokens):
        return super().key(ns, parent, [len(tokens)])


def records(values: list[str]) -> str:
    keys = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot"]
    return "".join(f"{k}: {v}\n" for k, v in zip(keys, values, strict=True)) + "delta:"


def _colliding_keys(guard_off: bool) -> None:
    """Two requests of one tenant whose pages collide by key: the stored-token compare keeps
    Y from answering out of X's KV; with the compare skipped, Y recalls X's value."""
    llm = LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=1024)
    llm.engine.pool.prefix.keyer = CollidingKeyer()
    rng = random.Random(11)
    xs, ys = [canary(rng) for _ in range(6)], [canary(rng) for _ in range(6)]
    x = ask(llm.engine, "x", records(xs), "A")
    assert x.text.strip() == xs[3]
    if guard_off:
        llm.engine.faults.arm("prefix_cache_skip_token_compare")
    y = ask(llm.engine, "y", records(ys), "A")
    llm.engine.faults.disarm("prefix_cache_skip_token_compare")
    if guard_off:
        # Y's answer carries one of X's values (positions shift a little between the two
        # prompts, so which record the recall lands on varies).
        assert y.cached > 0 and any(leaked(y.text, v) for v in xs), (y.text, xs)
    else:
        assert y.cached == 0 and y.text.strip() == ys[3]
    assert_baseline(llm.engine)


def test_a_key_match_alone_never_reuses_a_page() -> None:
    _colliding_keys(guard_off=False)


def test_twin_skipping_the_token_compare_y_recalls_x() -> None:
    _colliding_keys(guard_off=True)


def _sealed_write(guard_off: bool) -> None:
    """A page-table bug points a request's new tokens at a sealed page: the per-batch check
    fails that request closed and the cache stays intact; with the check off, the write lands
    and the next reader of the page gets a corrupted answer."""
    llm = LLM(str(TINY_MODEL), kv_pool_tokens=4096, context_length=1024)
    engine = llm.engine
    rng = random.Random(13)
    values = [canary(rng) for _ in range(6)]
    prompt = engine.tokenizer.encode(records(values))
    first = run_waves(engine, [[Ask("a1", prompt, "A")]], RECALL)["a1"]
    assert first.text.strip() == values[3]
    full = (len(prompt) - 1) // PAGE
    overwrite = prompt[: full * PAGE] + random_prompts([40], 2000, seed=3)[0]
    points = ["write_sealed_page"] + (["skip_tag_check"] if guard_off else [])
    with engine.faults.injected(*points):
        bug = run_waves(engine, [[Ask("a2", overwrite, "A")]], RECALL)["a2"]
    again = run_waves(engine, [[Ask("a3", prompt, "A")]], RECALL)["a3"]
    assert again.cached == full * PAGE
    if guard_off:
        assert bug.finish is not FinishReason.ERROR
        assert again.tokens != first.tokens, "the sealed page was overwritten, yet reads alike"
    else:
        assert bug.finish is FinishReason.ERROR and bug.error_code == "kv_integrity_error"
        assert again.tokens == first.tokens
    assert_baseline(engine)


def test_a_write_to_a_sealed_page_fails_closed() -> None:
    _sealed_write(guard_off=False)


def test_twin_without_the_tag_check_the_sealed_page_is_overwritten() -> None:
    _sealed_write(guard_off=True)
