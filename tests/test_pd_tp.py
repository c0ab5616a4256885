"""PD with tensor parallelism: a 1P1D pair with --tp-size 2 on both sides (gloo, one child rank
each, real TLS between the roles, in one test process). Greedy answers are token-exact with
--tp-size 1 and with transformers under continuous batching and decode preemption; the prefix
cache still spares the transfer on a second turn; a slice corrupted on decode's rank 1 after its
run's checksums passed fails the room (the read-back hashes every rank's slice; the twin with
checksums off commits it); a foreign destination page rank 0 let through (its check skipped) is
refused by rank 1's own check (I2; the twin lets rank 0 decide alone and rank 1 writes it); a
TP=2 prefill and a TP=1 decode refuse to pair (I7); a decode rank killed mid-decode fails its
requests closed while the prefill stays up and gets its pages back.

One module-scoped pair keeps this file's CI cost to one cluster's start (the kill test ends it,
so it runs last). qwen3, the prefill-side kill and the `kvfence up` run are behind RUN_SLOW=1:
`RUN_SLOW=1 .venv/bin/python -m pytest tests/test_pd_tp.py tests/test_up_e2e.py -k tp`."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from conftest import hf_greedy, random_prompts
from pd_harness import PDPair, Result, finished_ok
from pd_harness import _sink as sink
from test_engine_equivalence import run_staggered
from tls_certs import tls
from waiting import wait_for

from kvfence.config import EngineConfig
from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, SamplingParams
from kvfence.pd.decode import DecodeService
from kvfence.pd.protocol import PState

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PRESSURE = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# Decode's pool holds 8 pages of 16 (the least a 96-token context may have).
TIGHT = dict(kv_pool_tokens=128, context_length=96, chunked_prefill_size=96)
LENGTHS = [(7 * i) % 60 + 1 for i in range(8)]
WAIT_S = 120.0  # bounds for a loaded 2-core machine; a lost rank's own bound is --tp-timeout
SLOW = pytest.mark.skipif(os.environ.get("RUN_SLOW") != "1", reason="opt-in (RUN_SLOW=1)")


def tp_pair(model_dir: str) -> PDPair:
    return PDPair(model_dir, timeout_s=30.0, tp_size=2, threads=2, **TIGHT)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llama(checkpoint_dir) -> str:
    return str(checkpoint_dir("llama"))


@pytest.fixture(scope="module")
def unified(llama: str) -> LLM:
    """--tp-size 1, unified (test_pd.py shows it equals a TP=1 PD pair)."""
    return LLM(llama, **TIGHT)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pair(llama: str) -> Iterator[PDPair]:
    pd = tp_pair(llama)
    yield pd
    pd.close()


def submit(pair: PDPair, prompts: list[list[int]], params: SamplingParams) -> list[Result]:
    results = [pair.submit(p, params)[1] for p in prompts]
    assert all(isinstance(r, Result) for r in results), results
    return results  # type: ignore[return-value]


def finish(results: list[Result]) -> list[list[int]]:
    for r in results:
        assert r.done.wait(WAIT_S), "request did not finish"
    assert all(finished_ok(r) for r in results), [r.final for r in results]
    return [r.token_ids for r in results]


def check_token_exact(pair: PDPair, model_dir: str, unified: LLM) -> None:
    # Continuous batching: half the rooms, then the rest once the first half decodes.
    prompts = random_prompts(LENGTHS, vocab=256, seed=11)
    first = submit(pair, prompts[:4], GREEDY)
    wait_for(lambda: all(r.token_ids for r in first), WAIT_S, "the first half decoding")
    got = finish([*first, *submit(pair, prompts[4:], GREEDY)])
    assert got == run_staggered(unified.engine, prompts, GREEDY)
    assert got == hf_greedy(model_dir, prompts, GREEDY.max_tokens)  # type: ignore[arg-type]
    # Preemption: two answers that together outgrow decode's pool (4 + 6 of its 8 pages) and
    # decode side by side: when one needs a page and none is free, the newer one is preempted
    # and recomputed on decode's own ranks (whatever the timing: neither can finish early).
    pressure = random_prompts([14, 48], vocab=256, seed=12)
    before = pair.decode.engine.scheduler.num_preemptions
    got = finish(submit(pair, pressure, PRESSURE))
    assert pair.decode.engine.scheduler.num_preemptions > before, "decode's pool must run out"
    assert got == [u.token_ids for u in unified.generate(pressure, PRESSURE)]
    assert got == hf_greedy(model_dir, pressure, PRESSURE.max_tokens)  # type: ignore[arg-type]
    assert pair.wait_idle(WAIT_S)
    stats = pair.decode.transfer_stats
    assert stats.get("checksum_mismatches") == 0 and stats.get("grant_mismatches") == 0


def test_pd_tp2_greedy_token_exact_with_tp1_and_transformers_under_preemption(
    pair: PDPair, llama: str, unified: LLM
) -> None:
    check_token_exact(pair, llama, unified)
    # Every page crossed as both ranks' slices: the bytes are twice one rank's share.
    d = pair.decode
    assert d.transfer_stats.get("bytes_received") == pair.prefill.transfer_stats.get("bytes_sent")


def test_pd_tp2_prefix_cache_spares_the_second_turn(pair: PDPair, unified: LLM) -> None:
    first = random_prompts([40], vocab=256, seed=3)[0]
    r1 = pair.generate([first], GREEDY)[0]
    second = [*first, *r1.token_ids, *random_prompts([5], vocab=256, seed=4)[0]]
    r2 = pair.generate([second], GREEDY)[0]
    assert finished_ok(r1) and finished_ok(r2)
    assert r2.final is not None and r2.final.cached_tokens > 0
    assert [r1.token_ids, r2.token_ids] == [
        u.token_ids for u in unified.generate([first, second], GREEDY)
    ]
    assert pair.wait_idle(WAIT_S)


def _corrupted_slice(pair: PDPair, unified: LLM, guard_off: bool) -> Result:
    """Decode's rank 1 scrambles its slice of a room's first page after the run's checksums
    passed on rank 0: only the read-back of every rank's slice can see it."""
    prompt = random_prompts([37], vocab=256, seed=8)[0]
    points = ["tp_corrupt_rank_slice"] + (["skip_checksum"] if guard_off else [])
    with pair.faults.injected(*points):
        r = pair.generate([prompt], GREEDY)[0]
    assert r.final is not None
    want = unified.generate([prompt], GREEDY)[0].token_ids
    if guard_off:
        assert finished_ok(r) and r.token_ids != want, "the twin should commit the bad slice"
    else:
        assert r.final.finish_reason is FinishReason.ERROR
        assert r.final.error_code == "kv_transfer_incomplete"
        assert r.token_ids == []
    assert pair.wait_idle(WAIT_S)
    for svc in (pair.prefill, pair.decode):  # the bad page must not serve a later test
        svc.engine.pool.evict_unreferenced()
    return r


def test_i3_pd_tp_a_slice_corrupted_on_rank_1_fails_the_room(pair: PDPair, unified: LLM) -> None:
    _corrupted_slice(pair, unified, guard_off=False)


def test_i3_pd_tp_twin_without_checksums_rank_1s_bad_slice_is_committed(
    pair: PDPair, unified: LLM
) -> None:
    _corrupted_slice(pair, unified, guard_off=True)


def _write_into_a_foreign_page(pair: PDPair, leader_alone: bool) -> tuple[bool, int, Result]:
    """Decode's room names another tenant's page as its first destination, and rank 0 skips its
    own checks (destination and per-batch): (was rank 1's slice of that page overwritten, pages
    refused, the answer)."""
    decode, ps = pair.decode, pair.decode.engine.pool.page_size
    pool, slices, real = decode.engine.pool, decode.slices, decode.on_reserved
    assert slices is not None
    victim: list = []

    def steal(seq) -> None:  # engine thread: page 0 of the room becomes another tenant's
        grant = pool.new_grant("other", "victim")
        page = pool.allocate(grant, 1)[0]
        victim.append((grant, page, slices.rank_checksums([page], ps)[1]))
        seq.pages[0] = page
        real(seq)

    points = ["tp_rank_skips_tag_check"] + (["tp_leader_decides_alone"] if leader_alone else [])
    refused = decode.transfer_stats.get("grant_mismatches")
    decode.on_reserved = steal  # type: ignore[method-assign]
    try:
        with pair.faults.injected(*points):
            r = pair.generate([random_prompts([40], vocab=256, seed=5)[0]], GREEDY)[0]
    finally:
        decode.on_reserved = real  # type: ignore[method-assign]
    grant, page, before = victim[0]
    overwritten = slices.rank_checksums([page], ps)[1] != before
    pool.free(grant, [page])  # the engines are idle: nothing else touches the pool now
    assert pair.wait_idle(WAIT_S)
    return overwritten, decode.transfer_stats.get("grant_mismatches") - refused, r


def test_i2_pd_tp_rank_1_refuses_a_foreign_destination_rank_0_let_through(pair: PDPair) -> None:
    overwritten, refused, r = _write_into_a_foreign_page(pair, leader_alone=False)
    assert refused == 1 and not overwritten
    assert r.final is not None and r.final.finish_reason is FinishReason.ERROR
    assert r.final.error_code == "kv_transfer_incomplete" and r.token_ids == []


def test_i2_pd_tp_twin_when_rank_0_decides_alone_rank_1_writes_the_foreign_page(
    pair: PDPair,
) -> None:
    overwritten, refused, _ = _write_into_a_foreign_page(pair, leader_alone=True)
    assert refused == 0 and overwritten  # (and the answer, over a foreign page, may be a 200)


def test_i7_pd_tp2_prefill_refuses_a_tp1_decode_at_pairing(pair: PDPair, llama: str) -> None:
    cfg = EngineConfig(llama, tp_size=1, **TIGHT)  # type: ignore[arg-type]
    decode = DecodeService(cfg, 30.0, "tcp", tls("decode"), pair.faults)
    decode.start()
    try:
        res = Result()
        decode.submit(GenerateRequest("ab" * 16, "t", (1, 2, 3), GREEDY, pair.peer), sink(res))
        assert res.done.wait(WAIT_S)
        assert res.final is not None and res.final.finish_reason is FinishReason.ERROR
        assert "tp_layout" in str(res.final.error) and res.token_ids == []
        assert decode.transfer_stats.get("pairing_refused") == 1
        assert pair.prefill.transfer_stats.get("pairing_refused") >= 1
        # The refused request's pages are released on decode's engine thread after its error
        # is delivered: wait (bounded) for that, never read the count at once.
        wait_for(
            lambda: decode.engine.pool.num_used == 0,
            WAIT_S,
            lambda: f"decode pages still used: {decode.engine.pool.num_used}",
        )
    finally:
        decode.shutdown()


def test_pd_tp2_decode_rank_killed_mid_decode_fails_closed_prefill_recovers(
    pair: PDPair,
) -> None:
    """Runs last: it ends the module's pair."""
    long = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)  # 20 + 70 <= 96
    prompt = random_prompts([20], vocab=256, seed=5)[0]
    _, r = pair.submit(prompt, long)
    assert isinstance(r, Result)
    wait_for(lambda: len(r.token_ids) >= 2, WAIT_S, "decoding")
    tp = pair.decode.engine.tp
    assert tp is not None
    os.kill(tp.procs[0].pid, signal.SIGKILL)
    assert r.done.wait(WAIT_S), "no answer after the rank was killed"
    assert r.final is not None and r.final.finish_reason is FinishReason.ERROR
    assert r.final.error_code == "engine_failed" and len(r.token_ids) < long.max_tokens
    wait_for(lambda: not pair.decode.engine.alive, WAIT_S, "decode reports itself dead")
    assert pair.prefill.engine.alive
    wait_for(
        lambda: pair.prefill.engine.pool.num_used == 0 and not pair.prefill.rooms,
        WAIT_S,
        "prefill's pages back",
    )


# ---- RUN_SLOW=1 -------------------------------------------------------------------------------


@SLOW
def test_pd_tp2_qwen3_greedy_token_exact_under_preemption(checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir("qwen3"))
    pd = tp_pair(model_dir)
    try:
        check_token_exact(pd, model_dir, LLM(model_dir, **TIGHT))  # type: ignore[arg-type]
    finally:
        pd.close()


@SLOW
def test_pd_tp2_prefill_rank_killed_mid_transfer_fails_the_room_closed(llama: str) -> None:
    """Prefill's rank 1 dies while a room waits to send: the room is aborted (the engine's
    failure reaches it through its sink, or the slice gather raises), decode's client gets an
    error, decode stays up and gets its pages back."""
    pd = tp_pair(llama)
    try:
        pd.faults.stall_s = 2.0
        with pd.faults.injected("stall_transfer"):
            _, r = pd.submit(random_prompts([30], vocab=256, seed=6)[0], GREEDY)
            assert isinstance(r, Result)
            wait_for(
                lambda: any(
                    room.state.state is PState.SENDING for room in pd.prefill.rooms.values()
                ),
                WAIT_S,
                "the room sending",
            )
            tp = pd.prefill.engine.tp
            assert tp is not None
            os.kill(tp.procs[0].pid, signal.SIGKILL)
            assert r.done.wait(WAIT_S), "no answer after the prefill rank was killed"
        assert r.final is not None and r.final.finish_reason is FinishReason.ERROR
        assert r.final.error_code == "engine_failed", "an abort, not decode's timeout"
        assert r.token_ids == []
        assert pd.decode.engine.alive
        wait_for(lambda: pd.decode.engine.pool.num_used == 0, WAIT_S, "decode's pages back")
        wait_for(lambda: not pd.prefill.engine.alive, WAIT_S, "prefill reports itself dead")
    finally:
        pd.close()
