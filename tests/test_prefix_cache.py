"""The prefix cache's pure logic (kvfence/kv/prefix.py): keys that cannot cross namespaces, a key
match confirmed against stored tokens, exact reference counts, LRU eviction of unreferenced pages
only, the ttl, and operator-declared shared prefixes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfence.faults import Faults
from kvfence.kv.prefix import (
    SHARED,
    Namespace,
    NsKind,
    PageKeyer,
    PrefixCache,
    SharedPrefixes,
    encode_namespace,
    encode_page,
)

PS = 4


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def toks(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def take(cache: PrefixCache, holder: object, tokens: list[int], ns: Namespace) -> list[int]:
    """Match, then seal the rest of tokens' full pages as fresh pages (what the engine does)."""
    c = cache.chain(tokens, ns)
    pages = cache.match(holder, c, tokens, len(c))
    for i in range(len(pages), len(c)):
        page = next(_page_ids)
        assert cache.seal(holder, c, i, page, tokens)
        pages.append(page)
    return pages


_page_ids = itertools.count(1)


# ---- keys ------------------------------------------------------------------------------------


def test_namespace_encoding_is_typed_and_length_prefixed():
    # vLLM #44701: a LoRA named X and cache_salt X hashed alike. Here every field is tagged.
    pairs = [
        (Namespace.of_tenant("a", "bc"), Namespace.of_tenant("ab", "c")),
        (Namespace.of_tenant("t", "X"), Namespace.of_tenant("X")),
        (Namespace.of_tenant("X"), Namespace.of_tenant("t", "X")),
        (Namespace(NsKind.TENANT, "t", ""), Namespace.of_tenant("t")),
        (SHARED, Namespace.of_tenant("")),
    ]
    for a, b in pairs:
        assert a != b
        assert encode_namespace(a) != encode_namespace(b)


ns_strategy = st.one_of(
    st.just(SHARED),
    st.builds(
        Namespace,
        st.just(NsKind.TENANT),
        st.text(max_size=4),
        st.one_of(st.none(), st.text(max_size=4)),
    ),
)
page_input = st.tuples(
    ns_strategy,
    st.one_of(st.none(), st.binary(min_size=0, max_size=3)),
    st.lists(st.integers(0, 2**40), max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(page_input, page_input)
def test_page_encoding_is_injective(a, b):
    enc = [b"".join(encode_page(encode_namespace(ns), p, t)) for ns, p, t in (a, b)]
    assert (enc[0] == enc[1]) == (a == b)


def test_keys_depend_on_secret_namespace_parent_and_tokens():
    k = PageKeyer(b"s" * 16)
    ns = Namespace.of_tenant("acme")
    base = k.key(ns, None, [1, 2, 3, 4])
    assert base == k.key(ns, None, [1, 2, 3, 4])
    assert base != PageKeyer(b"t" * 16).key(ns, None, [1, 2, 3, 4])
    assert base != PageKeyer().key(ns, None, [1, 2, 3, 4])  # a fresh random secret
    assert base != k.key(Namespace.of_tenant("acme", "u1"), None, [1, 2, 3, 4])
    assert base != k.key(Namespace.of_tenant("other"), None, [1, 2, 3, 4])
    assert base != k.key(SHARED, None, [1, 2, 3, 4])
    assert base != k.key(ns, base, [1, 2, 3, 4])
    assert base != k.key(ns, None, [1, 2, 3, 5])
    assert len(base) == 32


def test_secret_must_be_at_least_128_bits():
    with pytest.raises(ValueError):
        PageKeyer(b"x" * 15)


def test_namespace_shapes_are_checked():
    with pytest.raises(ValueError):
        Namespace(NsKind.SHARED, "t")
    with pytest.raises(ValueError):
        Namespace(NsKind.TENANT, None)


# ---- match / seal / release ------------------------------------------------------------------


def test_reuse_within_a_namespace_only():
    cache = PrefixCache(PS)
    prompt = toks(10)  # two full pages and a partial one
    a = Namespace.of_tenant("A")
    pages_a = take(cache, "a1", prompt, a)
    assert len(pages_a) == 2
    c = cache.chain(prompt, a)
    assert cache.match("a2", c, prompt, 2) == pages_a
    for other in (Namespace.of_tenant("B"), Namespace.of_tenant("A", "salt"), SHARED):
        assert cache.match("x", cache.chain(prompt, other), prompt, 2) == []
    # Equal salts in two tenants are two namespaces.
    a_same, b_same = Namespace.of_tenant("A", "same"), Namespace.of_tenant("B", "same")
    take(cache, "s1", prompt, a_same)
    assert cache.match("s2", cache.chain(prompt, b_same), prompt, 2) == []
    assert len(cache.match("s3", cache.chain(prompt, a_same), prompt, 2)) == 2


def test_match_stops_at_the_first_difference_and_at_max_pages():
    cache = PrefixCache(PS)
    ns = Namespace.of_tenant("A")
    take(cache, "h", toks(12), ns)
    other = toks(4) + [99] + toks(7, 5)
    assert len(cache.match("m1", cache.chain(other, ns), other, 3)) == 1
    assert len(cache.match("m2", cache.chain(toks(12), ns), toks(12), 2)) == 2


class CollidingKeyer(PageKeyer):
    """Every page of a namespace gets the same key for the same position: a forced collision."""

    def key(self, ns, parent, tokens):
        return super().key(ns, parent, [len(tokens)])


def test_a_key_match_is_confirmed_against_the_stored_tokens():
    f = Faults()
    cache = PrefixCache(PS, keyer=CollidingKeyer(), faults=f)
    ns = Namespace.of_tenant("A")
    take(cache, "a", toks(8), ns)
    victim = toks(8, 50)
    c = cache.chain(victim, ns)
    assert c.keys == cache.chain(toks(8), ns).keys  # the collision is real
    assert cache.match("b", c, victim, 2) == []
    # Twin: trusting the hash alone hands out another prompt's pages.
    with f.injected("prefix_cache_skip_token_compare"):
        assert len(cache.match("b2", c, victim, 2)) == 2


def test_ignoring_the_namespace_crosses_tenants():
    """Twin of test_reuse_within_a_namespace_only: with the namespace left out of keys and
    checks, tenant B reuses tenant A's pages."""
    f = Faults()
    cache = PrefixCache(PS, faults=f)
    prompt = toks(8)
    with f.injected("prefix_cache_ignore_namespace"):
        take(cache, "a", prompt, Namespace.of_tenant("A"))
        c = cache.chain(prompt, Namespace.of_tenant("B"))
        assert len(cache.match("b", c, prompt, 2)) == 2


def test_refcounts_are_exact_and_release_is_by_holder():
    cache = PrefixCache(PS)
    ns = Namespace.of_tenant("A")
    pages = take(cache, "h1", toks(8), ns)
    c = cache.chain(toks(8), ns)
    cache.match("h2", c, toks(8), 2)
    cache.match("h3", c, toks(8), 1)
    assert [cache.refcount(p) for p in pages] == [3, 2]
    # What /metrics shows the chaos soak (holders, references: both 0 at rest).
    assert (cache.stats().holders, cache.stats().references) == (3, 5)
    cache.release("h2")
    assert [cache.refcount(p) for p in pages] == [2, 1]
    assert cache.num_evictable == 0
    cache.release("h1")
    assert [cache.refcount(p) for p in pages] == [1, 0]
    assert cache.evict(5) == [pages[1]]  # page 0 is still referenced by h3
    cache.release("h3")
    cache.release("h3")  # a second release is a no-op
    assert cache.evict(5) == [pages[0]]
    assert cache.num_cached == 0 and cache.num_holders == 0
    assert (cache.stats().holders, cache.stats().references) == (0, 0)


def test_eviction_is_lru_and_leaf_first():
    clock = FakeClock()
    cache = PrefixCache(PS, clock=clock)
    ns = Namespace.of_tenant("A")
    old = take(cache, "old", toks(8), ns)
    clock.t = 1
    new = take(cache, "new", toks(8, 100), ns)
    clock.t = 2
    cache.release("old")
    clock.t = 3
    cache.release("new")
    # old's chain went first, from its leaf.
    assert cache.evict(3) == [old[1], old[0], new[1]]
    clock.t = 4
    c = cache.chain(toks(8, 100), ns)
    assert cache.match("again", c, toks(8, 100), 2) == [new[0]]  # the leaf was evicted


def test_seal_refuses_duplicates_and_orphans():
    cache = PrefixCache(PS)
    ns = Namespace.of_tenant("A")
    prompt = toks(8)
    take(cache, "first", prompt, ns)
    c = cache.chain(prompt, ns)
    assert not cache.seal("second", c, 0, 1000, prompt)  # the key is cached already
    # Page 1's parent is not second's page: sealing it would leave an entry whose parent its
    # holder does not hold.
    longer = prompt + toks(4, 9)
    assert not cache.seal("second", cache.chain(longer, ns), 2, 1001, longer)
    assert not cache.is_cached(1000) and not cache.is_cached(1001)
    assert cache.held("second") == []


def test_ttl_expires_unreferenced_pages_only():
    clock = FakeClock()
    cache = PrefixCache(PS, ttl=10.0, clock=clock)
    ns = Namespace.of_tenant("A")
    gone = take(cache, "gone", toks(4), ns)
    kept = take(cache, "kept", toks(4, 50), ns)
    cache.release("gone")
    clock.t = 5
    assert cache.expire() == []
    clock.t = 11
    assert cache.expire() == gone
    assert cache.is_cached(kept[0]) and cache.refcount(kept[0]) == 1
    clock.t = 100
    assert cache.expire() == []  # referenced, however old


def test_shared_prefix_pages_cross_tenants_and_nothing_after_them():
    system = toks(10, 200)  # two full pages lie inside; the third page leaves it
    shared = SharedPrefixes([system], PS)
    cache = PrefixCache(PS, shared=shared)
    a, b = Namespace.of_tenant("A"), Namespace.of_tenant("B")
    prompt = system + toks(6, 1)
    ca = cache.chain(prompt, a)
    assert ca.namespaces == [SHARED, SHARED, a, a]
    pa = take(cache, "a", prompt, a)
    cb = cache.chain(prompt, b)
    assert cb.namespaces == [SHARED, SHARED, b, b]
    assert cache.match("b", cb, prompt, 4) == pa[:2]
    # A prompt that leaves the declared prefix inside page 1 shares page 0 only.
    diverge = system[:5] + [7] + system[6:] + toks(6, 1)
    cd = cache.chain(diverge, b)
    assert cd.namespaces == [SHARED, b, b, b]
    assert cache.match("d", cd, diverge, 4) == pa[:1]
    # A salted request still reads the public pages (public by definition), nothing else.
    cs = cache.chain(prompt, Namespace.of_tenant("A", "u"))
    assert cache.match("s", cs, prompt, 4) == pa[:2]


# ---- property: a random workload keeps every invariant ---------------------------------------

TENANTS = ("A", "B")
SALTS = (None, "x")


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        shared = SharedPrefixes([[7] * (2 * PS)], PS)
        # A tiny token alphabet makes shared prefixes (and would-be collisions) common.
        self.cache = PrefixCache(PS, shared=shared, clock=self.clock, ttl=50.0)
        self.next_page = itertools.count(1)
        self.holders: dict[int, tuple[Namespace, list[int], list[int]]] = {}
        self.next_holder = itertools.count()
        self.evicted: set[int] = set()

    @rule(
        tenant=st.sampled_from(TENANTS),
        salt=st.sampled_from(SALTS),
        tokens=st.lists(st.integers(6, 8), min_size=1, max_size=4 * PS),
    )
    def request(self, tenant: str, salt: str | None, tokens: list[int]) -> None:
        ns = Namespace.of_tenant(tenant, salt)
        h = next(self.next_holder)
        c = self.cache.chain(tokens, ns)
        limit = (len(tokens) - 1) // PS
        pages = self.cache.match(h, c, tokens, limit)
        for i, p in enumerate(pages):
            e = self.cache.entry(p)
            assert e is not None and e.refs > 0
            # No cross-namespace match ever: the entry's namespace is this request's (or the
            # shared one, only where the page lies inside a declared prefix), tokens equal.
            assert e.namespace == c.namespaces[i]
            assert e.namespace in (ns, SHARED)
            assert list(e.tokens) == tokens[i * PS : (i + 1) * PS]
        for i in range(len(pages), len(c)):
            page = next(self.next_page)
            if not self.cache.seal(h, c, i, page, tokens):
                break
            pages.append(page)
        self.holders[h] = (ns, tokens, pages)
        self.clock.t += 1

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def finish(self, data) -> None:
        h = data.draw(st.sampled_from(sorted(self.holders)))
        del self.holders[h]
        self.cache.release(h)
        self.clock.t += 1

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        before = self.cache.num_evictable
        out = self.cache.evict(n)
        assert len(out) == min(n, before)
        self._check_evicted(out)

    @rule(dt=st.integers(0, 60))
    def age(self, dt: int) -> None:
        self.clock.t += dt
        self._check_evicted(self.cache.expire())

    def _check_evicted(self, pages: list[int]) -> None:
        held = {p for _, _, ps in self.holders.values() for p in ps}
        assert not held & set(pages), "evicted a referenced page"
        assert not self.evicted & set(pages), "evicted a page twice"
        self.evicted |= set(pages)

    @invariant()
    def refcounts_exact(self) -> None:
        counts: dict[int, int] = {}
        for h, (_, _, pages) in self.holders.items():
            assert self.cache.held(h) == pages
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
        for p, n in counts.items():
            assert self.cache.refcount(p) == n
        referenced = sum(1 for p in counts if self.cache.is_cached(p))
        assert self.cache.num_cached == referenced + self.cache.num_evictable


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_namespace_ids_are_keyed_tags_with_no_growing_registry():
    cache = PrefixCache(PS)
    ids = {cache.namespace_id(Namespace.of_tenant("A", f"salt-{i}")) for i in range(5000)}
    assert len(ids) == 5000 and 0 not in ids  # a salt each: distinct, never the shared id
    assert cache.namespace_id(SHARED) == 0
    assert cache.namespace_id(Namespace.of_tenant("A")) == cache.namespace_id(
        Namespace.of_tenant("A")
    )
    assert cache.keyer.namespace_tag.cache_info().currsize <= 4096  # bounded, whatever comes
    other = PrefixCache(PS)  # another process: another secret, other ids
    assert other.namespace_id(Namespace.of_tenant("A")) != cache.namespace_id(
        Namespace.of_tenant("A")
    )
