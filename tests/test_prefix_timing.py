"""The prefix cache's timing side channel, measured (statistics asserted, never a time): within a
tenant a cached prefix is told from a fresh one by its time to first token; across tenants the
two TTFT distributions are indistinguishable (ROC AUC within 0.5 +- 0.05, KS p > 0.01), and with
the namespace ignored (the twin) they are not (AUC > 0.9). Pairs are interleaved in random
order. TTFT here is the engine thread's CPU time from submit to the first token, with torch on
one thread: on a shared test machine wall time is mostly other processes' load, which would
hide the effect the twins must show; the compute is what a remote clock sees on a quiet host
(benchmarks/prefix_timing.py measures wall-clock TTFT over HTTP)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import TINY_MODEL

from kvfence.engine.engine import Engine
from kvfence.engine.llm import LLM
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams
from kvfence.tools.leakcheck.timing_stats import auc, ks_pvalue, ks_statistic

PROMPT = 128  # tokens: a cached prefix skips all but its last page
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)
PAIRS_NULL = 500  # AUC's standard error under the null is ~0.018: 0.05 is ~2.7 of them
PAIRS_EFFECT = 60


def ttft_ns(engine: Engine, rid: str, tenant: str, prompt: list[int]) -> int:
    got: list[RequestOutput] = []
    t0 = time.thread_time_ns()
    engine.submit(GenerateRequest(rid, tenant, tuple(prompt), FIRST_TOKEN), got.append)
    while not got:
        engine.step()
    return time.thread_time_ns() - t0


def measure(engine: Engine, pairs: int, prober: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tenant A caches a random prompt; `prober` sends it and a fresh one of equal length, in
    random order. Returns (TTFTs of A's prompt, TTFTs of the fresh ones)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size

    def fresh() -> list[int]:
        return [rng.randrange(6, vocab) for _ in range(PROMPT)]  # 0-5: special tokens

    cached, control = [], []
    for i in range(pairs):
        secret, other = fresh(), fresh()
        ttft_ns(engine, f"a{i}", "A", secret)
        arms = [(cached, secret), (control, other)]
        rng.shuffle(arms)
        for j, (sink, prompt) in enumerate(arms):
            sink.append(ttft_ns(engine, f"p{i}-{j}", prober, prompt))
    return np.array(cached, dtype=float), np.array(control, dtype=float)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # all of a step's compute on the thread whose CPU time we read
    try:
        e = LLM(str(TINY_MODEL), kv_pool_tokens=8192, context_length=1024).engine
        measure(e, 5, "B", seed=0)  # warm up (kernels, allocator) outside the samples
        yield e
    finally:
        torch.set_num_threads(threads)


def test_within_a_tenant_a_cached_prefix_is_faster(engine: Engine) -> None:
    cached, control = measure(engine, PAIRS_EFFECT, "A", seed=1)
    assert auc(cached, control) > 0.9  # fresh prompts take longer than cached ones


def test_across_tenants_ttft_reveals_nothing(engine: Engine) -> None:
    hits = engine.stats().prefix_cache.hits
    cached, control = measure(engine, PAIRS_NULL, "B", seed=2)
    assert engine.stats().prefix_cache.hits == hits, "B reused some of A's pages"
    a = auc(cached, control)
    p = ks_pvalue(ks_statistic(cached, control), len(cached), len(control))
    assert abs(a - 0.5) <= 0.05 and p > 0.01, (a, p)


def test_twin_ignoring_the_namespace_shows_in_ttft(engine: Engine) -> None:
    with engine.faults.injected("prefix_cache_ignore_namespace"):
        cached, control = measure(engine, PAIRS_EFFECT, "B", seed=3)
    assert auc(cached, control) > 0.9
