"""I2: every KV read and write is checked against the request's grant in one tensor compare; a
mismatch fails that request closed and leaves the others sound. The twin turns the check off."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults
from kvfence.kv.pool import Grant, KVPool, OwnershipError, PoolExhausted

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def run_with_stolen_page(model: str | LLM, faults: Faults | None) -> dict[str, RequestOutput]:
    """Tenant b's page table is made to point at tenant a's first page mid-flight (on a fresh
    engine of model_dir, or on a given LLM's: test_tp.py's tensor-parallel one)."""
    llm = (
        model
        if isinstance(model, LLM)
        else LLM(model, faults, kv_pool_tokens=512, context_length=128)
    )
    engine = llm.engine
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


def check_foreign_page_fails_closed(model: str | LLM, faults: Faults | None = None) -> None:
    final = run_with_stolen_page(model, faults)
    assert final["b"].finish_reason is FinishReason.ERROR
    assert final["b"].error_code == "kv_integrity_error"
    assert final["a"].finish_reason is FinishReason.LENGTH
    assert final["a"].completion_tokens == 8


def test_i2_foreign_page_fails_request_closed(checkpoint_dir) -> None:
    check_foreign_page_fails_closed(str(checkpoint_dir("llama")))


def test_i2_twin_without_tag_check_the_breach_goes_unnoticed(checkpoint_dir) -> None:
    # Without the check, b decodes over a's page and finishes with a normal-looking answer.
    faults = Faults()
    with faults.injected("skip_tag_check"), pytest.raises(AssertionError):
        check_foreign_page_fails_closed(str(checkpoint_dir("llama")), faults)


def make_pool(pages: int = 4) -> KVPool:
    return KVPool(
        num_layers=1,
        num_pages=pages,
        page_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )


def test_i2_pool_grants_are_exclusive_and_a_freed_entry_never_validates() -> None:
    pool = make_pool()
    g1, g2 = pool.new_grant("a", "r1"), pool.new_grant("b", "r2")
    p1 = pool.allocate(g1, 2)
    p2 = pool.allocate(g2, 2)
    assert not set(p1) & set(p2)
    with pytest.raises(PoolExhausted):
        pool.allocate(g1, 1)
    with pytest.raises(OwnershipError):
        pool.free(g2, p1)
    pool.mark_written(g1, p1)
    assert pool.check_source(g1, p1, 2 * pool.page_size)
    pool.free(g1, p1)
    assert pool.num_free == 2
    # The same tenant's next grant gets the same pages back: g1's page table entries, taken
    # before the free, never validate again (grant ids are never reused: the generation).
    g3 = pool.new_grant("a", "r1")
    assert g3.grant_id != g1.grant_id and pool.allocate(g3, 2) == p1
    pool.mark_written(g3, p1)
    assert not pool.check_source(g1, p1, 2 * pool.page_size)
    assert pool.check_destination(g1, p1) == [False, False]
    assert pool.check_source(g3, p1, 2 * pool.page_size)


def test_i2_pool_allocation_is_all_or_nothing() -> None:
    pool = make_pool(3)
    g = pool.new_grant("a", "r")
    with pytest.raises(PoolExhausted):
        pool.allocate(g, 4)
    assert pool.num_free == 3


def test_poison_on_free_nans_freed_pages_and_answers_stay_exact(checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([5, 40, 70], vocab=256, seed=12)
    plain = LLM(model_dir, kv_pool_tokens=256, context_length=128)
    poisoned = LLM(model_dir, kv_pool_tokens=256, context_length=128, kv_poison_on_free=True)
    want = [c.token_ids for c in plain.generate(prompts, PARAMS)]
    assert [c.token_ids for c in poisoned.generate(prompts, PARAMS)] == want
    assert [c.token_ids for c in poisoned.generate(prompts, PARAMS)] == want  # reused pages
    pool = poisoned.engine.pool
    used = pool.written_by_for_tests()[1:] != -1  # pages that held data, all free again now
    assert used.any() and torch.isnan(pool.k[:, pool.page_size :]).any()


def test_poison_twin_a_stale_read_shows_as_nan_garbage(checkpoint_dir) -> None:
    """With the tag check off, a page table pointing at a freed page reads poison: the answer
    is visibly broken instead of silently carrying someone's stale data."""
    # The cache off: the first answer's pages must go back to the free list (poisoned), not
    # stay cached, for the page table below to point at a freed page.
    llm = LLM(
        str(checkpoint_dir("llama")),
        kv_pool_tokens=256,
        context_length=128,
        kv_poison_on_free=True,
        enable_prefix_caching=False,
    )
    prompt = random_prompts([40], vocab=256, seed=13)[0]
    [want] = llm.generate([prompt], PARAMS)
    engine = llm.engine
    outs: list[RequestOutput] = []
    engine.submit(GenerateRequest("s", "t", tuple(prompt), PARAMS), outs.append)
    engine.step()
    seq = engine.scheduler.running[0]
    # A page freed (so poisoned) just now: the pool hands out its lowest free pages first, so
    # the highest of four taken and returned is the last any later allocation would reuse.
    scratch = engine.pool.new_grant("other", "scratch")
    freed = engine.pool.allocate(scratch, 4)
    engine.pool.free(scratch, freed)
    seq.pages[0] = max(freed)
    with engine.faults.injected("skip_tag_check"):
        while not (outs and outs[-1].finished):
            engine.step()
    got = [t for o in outs for t in o.new_token_ids]
    assert outs[-1].finish_reason is FinishReason.LENGTH  # nothing stopped the stale read ...
    assert got != want.token_ids  # ... and the poison shows in the answer
    assert engine.pool.num_used == 0  # the pool survived the corrupt page list


def test_i2_transfer_source_read_is_checked(checkpoint_dir) -> None:
    """Prefill refuses to send a page its room does not own: the room fails closed (500)."""
    from pd_harness import PDPair, Result

    pair = PDPair(str(checkpoint_dir("llama")), kv_pool_tokens=512, context_length=128)
    real = pair.prefill._prefilled

    def steal(seq):  # the sender is handed a page table pointing at a free page
        seq.pages[0] = next(
            p for p in range(1, pair.prefill.engine.pool.num_pages + 1) if p not in seq.pages
        )
        real(seq)

    pair.prefill._prefilled = steal
    try:
        _, r = pair.submit(random_prompts([40], 256, seed=5)[0], PARAMS)
        assert isinstance(r, Result) and r.done.wait(30)
        assert r.final.finish_reason is FinishReason.ERROR
        assert r.final.error_code == "kv_integrity_error"
        assert pair.prefill.transfer_stats.get("pages_sent") == 0
    finally:
        pair.close()


def test_i2_transfer_destination_check_is_grant_and_tenant() -> None:
    pool = make_pool()
    a, b = pool.new_grant("a", "r1"), pool.new_grant("b", "r2")
    pa, pb = pool.allocate(a, 2), pool.allocate(b, 1)
    assert pool.check_destination(a, pa) == [True, True]
    assert pool.check_destination(a, [pa[0], pb[0]]) == [True, False]  # another grant's page
    forged = Grant(a.grant_id, b.tenant_id, a.request_id)  # a's grant id, another tenant
    assert pool.check_destination(forged, pa) == [False, False]
    assert "owners=" in pool.describe_owners(pa + pb)


def run_transfer_into_foreign_page(
    model_dir: str, faults: Faults | None = None
) -> tuple[bool, int]:
    """Decode's room is made to name another tenant's page as a destination: (was that page
    overwritten, pages the write path refused). The request fails closed either way (the commit
    check catches it later); what differs is whether the foreign page was written at all."""
    from pd_harness import PDPair, Result

    pair = PDPair(model_dir, faults=faults, kv_pool_tokens=512, context_length=128)
    pool = pair.decode.engine.pool
    real = pair.decode.on_reserved
    victim: list[int] = []

    def steal(seq):  # engine thread: the room's first page becomes another tenant's page
        victim.extend(pool.allocate(pool.new_grant("other", "victim"), 1))
        slots = slice(victim[0] * pool.page_size, (victim[0] + 1) * pool.page_size)
        pool.k[:, slots] = 7.0
        seq.pages[0] = victim[0]
        real(seq)

    pair.decode.on_reserved = steal
    try:
        _, r = pair.submit(random_prompts([40], 256, seed=5)[0], PARAMS)
        assert isinstance(r, Result) and r.done.wait(30), "the transfer never finished"
        assert r.final.finish_reason is FinishReason.ERROR
        slots = slice(victim[0] * pool.page_size, (victim[0] + 1) * pool.page_size)
        overwritten = not bool((pool.k[:, slots] == 7.0).all())
        return overwritten, pair.decode.transfer_stats.get("grant_mismatches")
    finally:
        pair.close()


def test_i2_transfer_destination_refuses_another_tenants_page(checkpoint_dir) -> None:
    overwritten, refused = run_transfer_into_foreign_page(str(checkpoint_dir("llama")))
    assert refused == 1
    assert not overwritten


def test_i2_twin_without_destination_check_the_foreign_page_is_written(checkpoint_dir) -> None:
    with Faults().injected("skip_dest_check") as faults:
        overwritten, refused = run_transfer_into_foreign_page(str(checkpoint_dir("llama")), faults)
    assert refused == 0
    assert overwritten
