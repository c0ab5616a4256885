"""I4: a page returns to the free list only when no writer can still write it. Late writes
after an abort are refused and counted; a prefill that never acknowledges an abort is fenced by
closing its connection. Either way the pools return to baseline and later answers are exact."""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest
from conftest import random_prompts
from pd_harness import PDPair, Result, finished_ok
from waiting import wait_for

from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.faults import Faults

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = random_prompts([60], 256, seed=41)[0]  # 4 pages
CHECK = random_prompts([25], 256, seed=42)[0]


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir) -> str:
    return str(checkpoint_dir("llama"))


def armed(*names: str) -> AbstractContextManager[Faults]:
    """The pair's faults, armed until the block ends (the prefill acts on them after the client
    left); the pair outlives the block to show it recovers."""
    return Faults().injected(*names)


def run(
    model_dir: str, faults: Faults, timeout_s: float = 10.0
) -> tuple[PDPair, Result, list[int]]:
    want = LLM(model_dir, kv_pool_tokens=512, context_length=128).generate([CHECK], GREEDY)
    pair = PDPair(model_dir, timeout_s, faults, kv_pool_tokens=512, context_length=128)
    _, r = pair.submit(LONG, GREEDY)
    assert isinstance(r, Result) and r.done.wait(30)
    return pair, r, want


def test_i4_late_writes_after_an_abort_are_refused(model_dir: str) -> None:
    with armed("client_disconnect", "stall_transfer", "late_write") as faults:
        pair, r, want = run(model_dir, faults)
        try:
            assert r.final.finish_reason is FinishReason.ABORT
            assert pair.wait_idle(), pair.pages_used()
            # After its stall the faulty prefill tries to send anyway, after its ABORT_ACK: its
            # own source check refuses pages it no longer owns, or decode drops what arrives.
            d, s = pair.decode.transfer_stats, pair.prefill.transfer_stats
            stopped = lambda: (  # noqa: E731
                s.get("source_integrity_errors") == 1 or d.get("late_writes_dropped") == 4
            )
            wait_for(stopped, 15, lambda: str((s.snapshot(), d.snapshot())), interval=0.1)
            assert d.get("pages_received") == 0
        except BaseException:
            pair.close()
            raise
    try:
        [after] = pair.generate([CHECK], GREEDY)  # reuses the aborted room's pages
        assert finished_ok(after) and after.token_ids == want[0].token_ids
    finally:
        pair.close()


def test_i4_missing_abort_ack_is_fenced_by_closing_the_connection(model_dir: str) -> None:
    with armed("client_disconnect", "stall_transfer", "drop_abort_ack") as faults:
        pair, r, want = run(model_dir, faults, timeout_s=1.0)
        idle = pair.wait_idle(timeout=10)
    try:
        assert r.final.finish_reason is FinishReason.ABORT
        assert idle, pair.pages_used()
        [after] = pair.generate([CHECK], GREEDY)  # over a fresh connection
        assert finished_ok(after) and after.token_ids == want[0].token_ids
    finally:
        pair.close()


def test_i4_twin_without_the_fence_pages_stay_held(model_dir: str) -> None:
    """The fence-by-close is what frees a room whose ack never comes: without the timeout
    (here: a timeout longer than the test waits) the pages stay held, which the check sees."""
    with armed("client_disconnect", "stall_transfer", "drop_abort_ack") as faults:
        pair, r, _ = run(model_dir, faults, timeout_s=60.0)
        idle = pair.wait_idle(timeout=4)
    try:
        assert r.final.finish_reason is FinishReason.ABORT
        with pytest.raises(AssertionError):
            assert idle, pair.pages_used()
    finally:
        pair.close()
