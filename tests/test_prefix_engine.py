"""The prefix cache in the unified engine: greedy output is token-exact with the cache on, off
and transformers, for every supported architecture, with many requests sharing prefixes under
staggered batching, chunked prefill, forced preemption and eviction; reference counts and free
pages return to baseline; aborts and identical concurrent requests keep counts exact."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import hf_greedy, random_prompts
from prefix_harness import Ask, assert_baseline, run_waves

from kvfence.cli import build_parser
from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.tools.up import UpConfig, add_up_args, worker_args

PAGE = 16
MAX_NEW = 16
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def sharing_prompts(seed: int) -> list[list[int]]:
    """Prompts over two bases: suffixes of several lengths, an exact repeat, a prompt that
    ends on a page boundary, one that is a strict prefix of a base, and two unrelated ones."""
    base_a, base_b, *other = random_prompts([3 * PAGE + 4, 2 * PAGE, 21, 40], 256, seed)
    tails = random_prompts([1, 5, PAGE, 20, 37], 256, seed + 1)
    return [
        base_a + tails[0],
        base_a + tails[1],
        base_b + tails[2],
        base_a + tails[3],
        base_a + tails[1],  # an exact repeat
        base_a[: 2 * PAGE],  # ends on a page boundary: its last token is recomputed
        base_b + tails[4],
        base_b,
        base_a[: PAGE + 3],
        *other,
        base_a + tails[2],
    ]


def waves_of(prompts: list[list[int]], tenant: str = "t") -> list[list[Ask]]:
    asks = [Ask(f"r{i}", p, tenant) for i, p in enumerate(prompts)]
    return [asks[:2], asks[2:5], asks[5:9], asks[9:]]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_token_exact_with_cache_on_off_and_transformers(arch: str, checkpoint_dir) -> None:
    model_dir = checkpoint_dir(arch)
    prompts = sharing_prompts(seed=11)
    want = hf_greedy(model_dir, prompts, MAX_NEW)
    # Tight: 16 pages for 12 requests of up to 6 pages each forces preemption and eviction;
    # chunks of 24 straddle page boundaries.
    # No step-time target (it reads the clock): the same chunks, so preemptions, on every machine.
    on = LLM(
        str(model_dir),
        kv_pool_tokens=256,
        context_length=128,
        chunked_prefill_size=24,
        max_decode_step_ms=0,
    )
    assert on.engine.runner.attention.name == "cpu_native"  # chunks behind cached prefixes
    got_on = run_waves(on.engine, waves_of(prompts), GREEDY)
    off = LLM(
        str(model_dir),
        kv_pool_tokens=2048,
        context_length=128,
        chunked_prefill_size=24,
        enable_prefix_caching=False,
    )
    got_off = run_waves(off.engine, waves_of(prompts), GREEDY)
    for i, w in enumerate(want):
        assert got_off[f"r{i}"].tokens == w, f"{arch}: cache off, prompt {i} diverged"
        assert got_on[f"r{i}"].tokens == w, f"{arch}: cache on, prompt {i} diverged"
        assert got_off[f"r{i}"].cached == 0
    stats = on.engine.stats()
    assert stats.preemptions > 0, "the pool was meant to run out"
    assert stats.prefix_cache is not None and stats.prefix_cache.hits > 0
    assert sum(a.cached for a in got_on.values()) > 0
    assert got_on["r4"].cached >= 3 * PAGE  # the exact repeat reused its whole base
    assert_baseline(on.engine)
    assert_baseline(off.engine)
    assert off.engine.stats().prefix_cache is None


def test_eviction_under_pressure_keeps_answers_exact(checkpoint_dir) -> None:
    """More distinct prefixes than the pool holds: cached pages are evicted (never referenced
    ones), later repeats recompute or reuse, and answers never change."""
    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([40] * 8, 256, seed=5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    llm = LLM(model_dir, kv_pool_tokens=128, context_length=128)
    for _ in range(2):
        for i, p in enumerate(prompts):
            [c] = llm.generate([p], params)
            assert c.token_ids == want[i]
    s = llm.engine.stats()
    assert s.prefix_cache is not None and s.prefix_cache.evictions > 0
    assert_baseline(llm.engine)


def test_identical_requests_at_once_and_aborts_keep_counts_exact(checkpoint_dir) -> None:
    """n > 1 in the engine's eyes: identical prompts in flight together; then aborts in prefill
    and in decode of requests that hold cache pages. Every count returns to baseline."""
    model_dir = str(checkpoint_dir("llama"))
    llm = LLM(model_dir, kv_pool_tokens=1024, context_length=128, chunked_prefill_size=20)
    engine = llm.engine
    [prompt] = random_prompts([50], 256, seed=9)
    [want] = hf_greedy(checkpoint_dir("llama"), [prompt], MAX_NEW)
    got = run_waves(engine, [[Ask(f"n{j}", prompt) for j in range(4)]], GREEDY)
    assert all(a.tokens == want for a in got.values())
    # The first computes the prompt; the others wait a step for its pages and share them.
    assert [got[f"n{j}"].cached for j in range(4)] == [0, 3 * PAGE, 3 * PAGE, 3 * PAGE]
    assert not engine.scheduler.inflight
    assert_baseline(engine)
    # Now the prompt's pages are cached: three more hold them; abort one right after it
    # entered and one a few tokens later.
    outs: dict[str, list] = {"x": [], "y": [], "z": []}
    for rid in outs:
        engine.submit(GenerateRequest(rid, "t", tuple(prompt), GREEDY), outs[rid].append)
    engine.step()
    assert engine.pool.prefix.num_holders == 3
    engine.abort("x")
    for _ in range(3):
        engine.step()
    engine.abort("y")
    while not (outs["z"] and outs["z"][-1].finished):
        engine.step()
    assert outs["x"][-1].finish_reason is FinishReason.ABORT
    assert outs["y"][-1].finish_reason is FinishReason.ABORT
    assert [t for o in outs["z"] for t in o.new_token_ids] == want
    assert outs["z"][-1].cached_tokens == 3 * PAGE
    assert_baseline(engine)


def test_sealed_pages_fill_as_decoding_goes(checkpoint_dir) -> None:
    """A request's generated tokens are sealed too once their page is full: a follow-up turn
    that repeats the answer reuses it (multi-turn chat)."""
    model_dir = str(checkpoint_dir("llama"))
    llm = LLM(model_dir, kv_pool_tokens=1024, context_length=128)
    [prompt] = random_prompts([20], 256, seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    [first] = llm.generate([prompt], params)
    turn2 = prompt + first.token_ids + random_prompts([6], 256, seed=8)[0]
    got = run_waves(llm.engine, [[Ask("t2", turn2, tenant="default")]], params)
    assert got["t2"].cached == 3 * PAGE  # 56 tokens, all but the last partial page
    # The hit rate is over every prompt looked up, the first turn's miss included.
    stats = llm.engine.stats().prefix_cache
    assert (stats.queries, stats.hits) == (len(prompt) + len(turn2), 3 * PAGE)
    [want] = hf_greedy(checkpoint_dir("llama"), [turn2], 30)
    assert got["t2"].tokens == want
    assert_baseline(llm.engine)


def test_flags_and_config() -> None:
    def cfg(*flags: str) -> EngineConfig:
        return EngineConfig.from_args(build_parser().parse_args(["serve", "--model", "m", *flags]))

    on = cfg()
    assert on.enable_prefix_caching and on.shared_prefix_file is None
    for flags in (["--no-enable-prefix-caching"], ["--disable-radix-cache"]):
        assert not cfg(*flags).enable_prefix_caching
    assert cfg("--enable-prefix-caching").enable_prefix_caching
    got = cfg("--shared-prefix-file", "f", "--prefix-cache-ttl", "9")
    assert (got.shared_prefix_file, got.prefix_cache_ttl) == ("f", 9.0)
    with pytest.raises(ConfigError):
        EngineConfig(model="m", prefix_cache_ttl=0)
    with pytest.raises(ConfigError):
        EngineConfig(model="m", enable_prefix_caching=False, shared_prefix_file="f")
    # `kvfence up` passes "off" on to its workers.
    up = argparse.ArgumentParser()
    add_up_args(up)
    args = up.parse_args(["--model", "m", "--disable-radix-cache"])
    flags = worker_args(UpConfig.from_args(args), "decode")
    assert "--no-enable-prefix-caching" in flags
    assert not cfg(*flags[2:]).enable_prefix_caching


def test_ttl_expires_unused_pages_and_poisons_them(checkpoint_dir) -> None:
    """--prefix-cache-ttl: a namespace's pages unused for that long leave the cache at the next
    step (poisoned with --kv-poison-on-free), so a repeat recomputes, still token-exact."""
    model_dir = str(checkpoint_dir("llama"))
    llm = LLM(
        model_dir,
        kv_pool_tokens=1024,
        context_length=128,
        prefix_cache_ttl=5.0,
        kv_poison_on_free=True,
    )
    engine = llm.engine
    now = [0.0]
    engine.pool.prefix.clock = lambda: now[0]
    [prompt, other] = random_prompts([40, 30], 256, seed=12)
    first = run_waves(engine, [[Ask("a", prompt)]], GREEDY)["a"]
    cached_pages = [
        p for p in range(1, engine.pool.num_pages + 1) if engine.pool.prefix.is_cached(p)
    ]
    assert len(cached_pages) == 3  # two of the prompt, one full of generated tokens
    now[0] = 4.0
    assert run_waves(engine, [[Ask("b", prompt)]], GREEDY)["b"].cached == 2 * PAGE
    now[0] = 20.0  # 16 s unused
    # What every step's schedule does first. Checked here, before any allocation: the pool hands
    # out its lowest free pages, so the next request would take (and overwrite) these at once.
    engine.pool.expire_prefix()
    assert not any(engine.pool.prefix.is_cached(p) for p in cached_pages)
    assert all(torch.isnan(engine.pool.k[:, p * PAGE : (p + 1) * PAGE]).all() for p in cached_pages)
    run_waves(engine, [[Ask("c", other)]], GREEDY)
    again = run_waves(engine, [[Ask("d", prompt)]], GREEDY)["d"]
    assert again.cached == 0 and again.tokens == first.tokens
    assert engine.stats().prefix_cache.evictions >= 2
    assert_baseline(engine)


def test_shared_prefix_file_is_validated(tmp_path) -> None:
    from kvfence.kv.prefix import load_shared_prefixes

    def encode(text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    f = tmp_path / "p.json"
    f.write_text(json.dumps(["ab", [1, 2, 3]]))
    assert load_shared_prefixes(str(f), encode, 100) == [[47, 48], [1, 2, 3]]
    for bad in ("{}", "[1]", "[[1, 200]]", "[[]]", '[[1, "2"]]', "not json"):
        f.write_text(bad)
        with pytest.raises(ValueError, match="--shared-prefix-file"):
            load_shared_prefixes(str(f), encode, 100)
    with pytest.raises(ValueError, match="--shared-prefix-file"):
        load_shared_prefixes(str(tmp_path / "missing.json"), encode, 100)


def test_random_workload_keeps_every_invariant_at_every_step(checkpoint_dir) -> None:
    """Three tenants (some salted) over shared bases, a pool that forces preemption and
    eviction, aborts at random steps. After every step: each cache page's reference count is
    the number of live sequences holding it, and every page a sequence holds by reference is
    of its namespace (or the shared one) with its own tokens. Answers equal the cache-off ones;
    everything returns to baseline."""
    import random

    from kvfence.kv.prefix import SHARED, Namespace

    model_dir = str(checkpoint_dir("llama"))
    rng = random.Random(21)
    bases = random_prompts([2 * PAGE, 3 * PAGE + 3], 256, seed=30)
    asks = []
    for i in range(24):
        tenant = rng.choice(["A", "B", "C"])
        salt = rng.choice([None, None, "s"])
        tail = random_prompts([rng.randrange(1, 30)], 256, seed=100 + i)[0]
        asks.append(
            Ask(f"q{i}", rng.choice(bases)[: rng.randrange(PAGE, 3 * PAGE)] + tail, tenant, salt)
        )
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = run_waves(
        LLM(model_dir, kv_pool_tokens=4096, context_length=128, enable_prefix_caching=False).engine,
        [asks],
        params,
    )
    llm = LLM(  # no step-time target (it reads the clock): the same run on every machine
        model_dir, kv_pool_tokens=144, context_length=128, chunked_prefill_size=24,
        max_decode_step_ms=0,
    )
    engine, prefix = llm.engine, llm.engine.pool.prefix
    answers: dict[str, list[RequestOutput]] = {a.rid: [] for a in asks}
    aborted: set[str] = set()
    pending = list(asks)
    steps = 0
    while pending or engine.scheduler.has_work():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                a = pending.pop(0)
                req = GenerateRequest(a.rid, a.tenant, tuple(a.prompt), params, cache_salt=a.salt)
                engine.submit(req, answers[a.rid].append)
        if rng.random() < 0.08:
            rid = rng.choice([a.rid for a in asks])
            if not (answers[rid] and answers[rid][-1].finished):
                aborted.add(rid)
                engine.abort(rid)
        engine.step()
        steps += 1
        assert steps < 5000
        live = [s for s in engine.scheduler.running if s.grant is not None]
        holders: dict[int, int] = {}
        for s in live:
            ns = Namespace.of_tenant(s.tenant, s.admitted.request.cache_salt)
            for i, p in enumerate(s.pages[: s.num_sealed]):
                holders[p] = holders.get(p, 0) + 1
                e = prefix.entry(p)
                assert e is not None and e.namespace in (ns, SHARED)
                assert list(e.tokens) == s.token_ids[i * PAGE : (i + 1) * PAGE]
        for p, n in holders.items():
            assert prefix.refcount(p) == n
        assert prefix.num_holders == len({id(s) for s in live if s.num_sealed})
    for a in asks:
        outs = answers[a.rid]
        assert outs and outs[-1].finished
        if a.rid not in aborted:
            assert [t for o in outs for t in o.new_token_ids] == want[a.rid].tokens, a.rid
    assert engine.stats().preemptions > 0 and engine.stats().prefix_cache.hits > 0
    assert_baseline(engine)
