"""PD over real TCP, in one process: token-exact with unified, the three admission doors, aborts
and pool accounting on both sides."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, random_prompts
from pd_harness import PDPair, Result, finished_ok
from waiting import wait_for

from kvfence.engine.admission import Rejected
from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.pd.protocol import DState, PState

CTX = 256
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir) -> str:
    return str(checkpoint_dir("llama"))


def make_pair(model_dir: str, backend: str = "tcp") -> PDPair:
    if backend == "mooncake":
        from kvfence.pd.transport import mooncake

        if not mooncake.available():
            pytest.skip("mooncake transfer engine not installed (pip install 'kvfence[mooncake]')")
    return PDPair(
        model_dir,
        backend=backend,
        kv_pool_tokens=1024,
        context_length=CTX,
        chunked_prefill_size=64,
    )


@pytest.fixture
def pair(model_dir: str):
    pd = make_pair(model_dir)
    yield pd
    pd.close()


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
def test_pd_greedy_equals_unified_and_transformers(backend: str, model_dir: str) -> None:
    pair = make_pair(model_dir, backend)
    try:
        check_equivalence(pair, model_dir)
    finally:
        pair.close()


def check_equivalence(pair: PDPair, model_dir: str) -> None:
    lengths = [1, 15, 16, 17, CTX - GREEDY.max_tokens]
    prompts = random_prompts(lengths, vocab=256, seed=21)
    got = pair.generate(prompts, GREEDY)
    assert all(finished_ok(r) for r in got)
    unified = LLM(model_dir, kv_pool_tokens=1024, context_length=CTX).generate(prompts, GREEDY)
    hf = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    for n, r, u, h in zip(lengths, got, unified, hf, strict=True):
        assert r.token_ids == u.token_ids == h, f"prompt of {n} tokens"
    assert pair.wait_idle()
    assert pair.decode.transfer_stats.get("transfers_committed") == len(prompts)
    assert pair.decode.transfer_stats.get("checksum_mismatches") == 0


def test_pd_many_concurrent_two_tenants(pair: PDPair) -> None:
    prompts = random_prompts([(11 * i) % 90 + 1 for i in range(24)], vocab=256, seed=5)
    results: list[Result] = []
    for i, p in enumerate(prompts):
        _, r = pair.submit(p, GREEDY, tenant=f"tenant-{i % 2}")
        assert isinstance(r, Result)
        results.append(r)
    for r in results:
        assert r.done.wait(60)
    assert all(finished_ok(r) and len(r.token_ids) == GREEDY.max_tokens for r in results)
    assert pair.wait_idle()


def test_i1_pd_over_length_rejected_at_decode_before_any_page_or_transfer(pair: PDPair) -> None:
    for n, max_tokens in ((CTX + 1, 1), (CTX - 2, 5), (1025, 1)):
        _, verdict = pair.submit([5] * n, SamplingParams(max_tokens=max_tokens))
        assert isinstance(verdict, Rejected)
        assert verdict.code in ("context_length_exceeded", "exceeds_kv_pool")
    assert pair.pages_used() == (0, 0)
    assert (
        pair.decode.transfer_stats.get("reserved") == 0
        and pair.prefill.transfer_stats.get("reserves") == 0
    )


def test_i1_prefill_door_rejects_what_a_misconfigured_decode_let_in(pair: PDPair) -> None:
    # Simulate a decode whose own door is wider than prefill's (e.g. a stale config).
    from dataclasses import replace

    pair.decode.engine.limits = replace(pair.decode.engine.limits, context_length=10 * CTX)
    _, r = pair.submit([5] * (CTX + 10), SamplingParams(max_tokens=2, temperature=0))
    assert isinstance(r, Result) and r.done.wait(30)
    assert r.final.finish_reason is FinishReason.ERROR
    assert r.final.error_status == 400 and r.final.error_code == "context_length_exceeded"
    assert r.token_ids == []
    assert (
        pair.prefill.transfer_stats.get("rejected") == 1
        and pair.prefill.transfer_stats.get("pages_sent") == 0
    )
    assert pair.wait_idle()


def test_pd_client_abort_before_commit_releases_both_pools(pair: PDPair) -> None:
    # The stall holds prefill's computed room before its first page, far longer than the test
    # takes: the abort lands while both sides hold the room, before anything can commit.
    pair.faults.stall_s = 120.0
    with pair.faults.injected("stall_transfer"):
        rid, r = pair.submit(random_prompts([40], 256)[0], GREEDY)
        assert isinstance(r, Result)

        def both_hold_the_room() -> bool:
            d, pf = pair.decode.rooms.get(rid), pair.prefill.rooms.get(rid)
            return (
                d is not None
                and d.state.state is DState.RESERVED
                and pf is not None
                and pf.state.state is PState.SENDING
            )

        wait_for(both_hold_the_room, 60, "the room never reached the stall", interval=0.1)
        assert pair.pages_used()[0] > 0 and pair.pages_used()[1] > 0
        pair.decode.engine.abort(rid)
        assert r.done.wait(30) and r.final.finish_reason is FinishReason.ABORT
        assert pair.wait_idle(), pair.pages_used()
    assert pair.decode.transfer_stats.get("transfers_committed") == 0
    assert pair.decode.transfer_stats.get("pages_received") == 0


def test_pd_unreachable_prefill_fails_with_503_and_frees_pages(pair: PDPair) -> None:
    pair.peer = "127.0.0.1:1"  # nothing listens there
    _, r = pair.submit([5] * 20, GREEDY)
    assert isinstance(r, Result) and r.done.wait(30)
    assert r.final.finish_reason is FinishReason.ERROR and r.final.error_status == 503
    assert pair.wait_idle()


def test_pd_decode_computes_a_prompt_itself_when_the_prefill_queue_is_long(
    pair: PDPair, model_dir: str
) -> None:
    # A prefill queue far longer than decode's own: every prompt is computed at decode, with
    # the same answer as unified and nothing sent between the workers.
    pair.decode.pending.factor = 2.0
    pair.decode.pending.limit = 10**6
    pair.decode.pending.there = 10**6
    prompts = random_prompts([5, 40, 100], vocab=256, seed=3)
    got = pair.generate(prompts, GREEDY)
    unified = LLM(model_dir, kv_pool_tokens=1024, context_length=CTX).generate(prompts, GREEDY)
    assert [r.token_ids for r in got] == [u.token_ids for u in unified]
    assert pair.wait_idle()
    assert pair.decode.transfer_stats.get("prefilled_here") == len(prompts)
    assert pair.decode.transfer_stats.get("transfers_committed") == 0
    assert pair.decode.transfer_stats.get("reserved") == 0
    assert (pair.decode.pending.here, pair.decode.pending.there) == (0, 10**6)
    assert pair.decode.pending.streams == 0  # each stream counted out at its final output


def test_pd_a_decode_taking_prompts_keeps_the_narrow_step_target(model_dir: str) -> None:
    from dataclasses import replace

    from pd_harness import decode_service, pd_node

    from kvfence.config import EngineConfig
    from kvfence.engine.step_budget import AUTO_STEP_FACTOR
    from kvfence.faults import Faults

    node = pd_node(EngineConfig(model=model_dir, kv_pool_tokens=1024, context_length=CTX),
                   "decode", 5.0)  # fmt: skip
    from kvfence.pd.local_prefill import LOCAL_BACKLOG_STEPS

    for factor, wide, backlog in (
        (1.0, AUTO_STEP_FACTOR, LOCAL_BACKLOG_STEPS),
        (0.0, node.engine.wide_step_factor, node.engine.prefill_backlog_steps),
    ):
        svc = decode_service(replace(node, pd=replace(node.pd, decode_local_prefill=factor)),
                             Faults())  # fmt: skip
        try:
            assert svc.engine.scheduler.limits.step.wide_factor == wide
            assert svc.engine.scheduler.limits.step.backlog_steps == backlog
            assert svc.pending.limit == node.engine.chunked_prefill_size
        finally:
            svc.shutdown()


def test_pd_decode_borrows_threads_only_with_its_own_set_and_a_borrow(model_dir: str) -> None:
    from dataclasses import replace

    from pd_harness import decode_service, pd_node

    from kvfence.config import EngineConfig
    from kvfence.faults import Faults

    cfg = EngineConfig(model=model_dir, kv_pool_tokens=1024, context_length=CTX, threads=1)
    node = pd_node(cfg, "decode", 5.0)
    for threads, borrow, idle in ((1, 1, 2), (1, 0, None), (None, 1, None)):
        engine = replace(cfg, threads=threads)
        pd = replace(node.pd, decode_borrow_threads=borrow)
        svc = decode_service(replace(node, engine=engine, pd=pd), Faults())
        try:
            step_threads = svc.engine.step_threads
            assert (step_threads and step_threads()) == idle
            if step_threads is not None:
                svc.pending.remote = 1  # a prompt of its own at the prefill worker
                assert step_threads() == 1
        finally:
            svc.shutdown()


def test_pd_decode_prices_a_prompt_by_its_own_fitted_steps(pair: PDPair) -> None:
    from kvfence.engine.step_budget import StepCost
    from kvfence.pd.local_prefill import LocalPace

    budget = pair.decode.engine.scheduler.step_budget
    assert pair.decode._pace(0) is None or budget.beside() is not None  # no fit: unpriced
    cost = StepCost(a=10.0, b=0.5, c=1.0)
    budget._beside = (cost, 2)  # as the engine thread publishes it after a step
    chunk = pair.decode.chunk
    # rows: the last step's 2, or the 5 prompts awaiting their KV if more
    assert pair.decode._pace(0) == LocalPace.of(cost, 2, budget.at_target(cost, 2), chunk)
    assert pair.decode._pace(5) == LocalPace.of(cost, 5, budget.at_target(cost, 5), chunk)
