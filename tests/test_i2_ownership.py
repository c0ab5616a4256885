"""I2: every KV read and write is checked against the request's grant in one tensor compare; a
mismatch fails that request closed and leaves the others sound. The twin turns the check off."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from kvfence import faults
from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.kv.pool import KVPool, OwnershipError, PoolExhausted

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run_with_stolen_page(model_dir: str) -> dict[str, RequestOutput]:
    """Tenant b's page table is made to point at tenant a's first page mid-flight."""
    engine = LLM(model_dir, kv_pool_tokens=512, context_length=128).engine
    a, b = random_prompts([40, 40], vocab=256, seed=4)
    final: dict[str, RequestOutput] = {}

    def sink(o: RequestOutput) -> None:
        if o.finished:
            final[o.request_id] = o

    engine.submit(GenerateRequest("a", "tenant-a", tuple(a), PARAMS), sink)
    engine.submit(GenerateRequest("b", "tenant-b", tuple(b), PARAMS), sink)
    engine.step()  # both prefilled, each holding its own pages
    seq_a, seq_b = engine.scheduler.running
    seq_b.pages[0] = seq_a.pages[0]  # the bug being simulated: a stale or foreign page id
    while len(final) < 2:
        engine.step()
    assert engine.stats().pages_used == 0, "the failed request leaked pages"
    assert engine.pool.num_free == engine.pool.num_pages
    return final


def test_i2_foreign_page_fails_request_closed(checkpoint_dir) -> None:
    final = run_with_stolen_page(str(checkpoint_dir("llama")))
    assert final["b"].finish_reason is FinishReason.ERROR
    assert final["b"].error_code == "kv_integrity_error"
    assert final["a"].finish_reason is FinishReason.LENGTH
    assert final["a"].completion_tokens == 8


def test_i2_twin_without_tag_check_the_breach_goes_unnoticed(checkpoint_dir) -> None:
    # Without the check, b decodes over a's page; only the pool's strict free trips later.
    with faults.injected("skip_tag_check"), pytest.raises((AssertionError, OwnershipError)):
        test_i2_foreign_page_fails_request_closed(checkpoint_dir)


def make_pool(pages: int = 4) -> KVPool:
    return KVPool(
        num_layers=1,
        num_pages=pages,
        page_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=__import__("torch").float32,
        device="cpu",
    )


def test_i2_pool_grants_are_exclusive_and_free_bumps_generation() -> None:
    pool = make_pool()
    g1, g2 = pool.new_grant("a", "r1"), pool.new_grant("b", "r2")
    p1 = pool.allocate(g1, 2)
    p2 = pool.allocate(g2, 2)
    assert not set(p1) & set(p2)
    with pytest.raises(PoolExhausted):
        pool.allocate(g1, 1)
    with pytest.raises(OwnershipError):
        pool.free(g2, p1)
    gen_before = pool.generation[p1].clone()
    pool.free(g1, p1)
    assert (pool.generation[p1] == gen_before + 1).all()
    assert pool.num_free == 2


def test_i2_pool_allocation_is_all_or_nothing() -> None:
    pool = make_pool(3)
    g = pool.new_grant("a", "r")
    with pytest.raises(PoolExhausted):
        pool.allocate(g, 4)
    assert pool.num_free == 3
