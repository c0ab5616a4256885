"""A decode worker's choice between its prefill worker and its own steps for a prompt
(kvfence/pd/local_prefill.py): the arithmetic and the counters, no engine, no clock."""

from __future__ import annotations

import pytest

from kvfence.config import ConfigError, PdConfig
from kvfence.engine.request import FinishReason, RequestOutput
from kvfence.engine.step_budget import StepCost
from kvfence.pd.local_prefill import IDLE_FACTOR, LocalPace, PendingPrompts, computes_here


def _out(final: bool = False) -> RequestOutput:
    return RequestOutput("r", (1,), "x", FinishReason.LENGTH if final else None, 4, 1)


def test_an_idle_prefill_keeps_every_prompt():
    assert not computes_here(here=0, there=0, prompt=256, factor=2.0, limit=10**9)


def test_a_long_prefill_queue_sends_the_prompt_here():
    # (0 + 256) * 2 = 512 < 600 + 256
    assert computes_here(here=0, there=600, prompt=256, factor=2.0, limit=10**9)


def test_the_local_queue_counts_at_factor():
    # (256 + 256) * 2 = 1024 is not < 600 + 256: the local queue is already the longer wait
    assert not computes_here(here=256, there=600, prompt=256, factor=2.0, limit=10**9)
    assert computes_here(here=256, there=800, prompt=256, factor=2.0, limit=10**9)


def test_a_decode_holds_at_most_its_limit_of_local_prompts_but_always_one():
    assert not computes_here(here=256, there=10**6, prompt=256, factor=1.0, limit=500)
    assert computes_here(here=0, there=10**6, prompt=900, factor=1.0, limit=500)


def test_factor_zero_is_the_pd_path_only():
    assert not computes_here(here=0, there=10**9, prompt=1, factor=0.0, limit=10**9)


def test_claims_balance_the_two_queues():
    q = PendingPrompts(2.0)
    q.streams = 1  # the factor stands for the streams a local prompt delays
    where = [q.claim(256) for _ in range(8)]
    # Two go to the prefill first (256 * 2 is not < 256 + 256); then about one in three here.
    assert where[:3] == [False, False, True]
    assert where.count(True) >= 2
    assert q.here + q.there == 8 * 256
    assert q.there >= 2 * q.here


def test_the_first_output_settles_a_claim_once():
    q = PendingPrompts(2.0)
    seen: list[int] = []
    local = q.claim(100)
    sink = q.sink(local, 100, seen.append)
    assert q.there == 100
    first, second = _out(), _out()
    sink(first)
    sink(second)
    assert seen == [first, second]
    assert (q.here, q.there) == (0, 0)


def test_a_request_is_a_stream_from_its_first_output_to_its_final_one():
    q = PendingPrompts(2.0)
    a = q.sink(q.claim(100), 100, lambda _out: None)
    b = q.sink(q.claim(100), 100, lambda _out: None)
    assert q.streams == 0  # claimed, no first token yet
    a(_out())
    b(_out())
    a(_out())
    assert q.streams == 2
    a(_out(final=True))
    assert q.streams == 1
    # A request whose first output is its last (one token, an error) never decodes here.
    c = q.sink(q.claim(100), 100, lambda _out: None)
    c(_out(final=True))
    assert q.streams == 1
    b(_out(final=True))
    assert q.streams == 0


def test_the_factor_holds_only_while_streams_decode_here():
    # (0 + 256) * 2 = 512 is not < 200 + 256, but 256 < 456: the factor decides
    assert IDLE_FACTOR == 1.0
    q = PendingPrompts(2.0)
    q.there, q.streams = 200, 1
    assert not q.claim(256)
    q.settle(False, 256)
    q.streams = 0  # nobody would wait through the prompt's tokens here
    assert q.claim(256)
    # A factor below the idle one stays: the operator asked for more local prompts than that.
    low = PendingPrompts(0.5)
    assert low.claim(256)


def test_a_burst_into_an_idle_pair_is_split_between_the_workers():
    idle, busy = PendingPrompts(3.0), PendingPrompts(3.0)
    busy.streams = 1
    pace = LocalPace(here_ms=1.0, there_ms=1.0)
    at_idle = [idle.claim(256, lambda _r: pace) for _ in range(8)]
    at_busy = [busy.claim(256, lambda _r: pace) for _ in range(8)]
    assert at_idle.count(True) == 4
    assert at_busy.count(True) == 2


def test_a_decode_borrows_threads_only_while_none_of_its_prompts_is_at_the_prefill():
    q = PendingPrompts(0.5)
    assert q.step_threads(1, 1) == 2
    assert q.claim(256)  # computed here: the prefill worker still has none of them
    assert q.step_threads(1, 1) == 2
    assert not q.claim(256, lambda _r: LocalPace(here_ms=10.0, there_ms=1.0))  # sent there
    assert q.step_threads(1, 1) == 1
    q.settle(False, 256)  # its first token is out: the prefill worker is done with it
    assert q.step_threads(1, 1) == 2
    assert q.step_threads(2, 0) == 2


def test_settle_undoes_a_refused_claim():
    q = PendingPrompts(2.0)
    q.there = 1000
    assert q.claim(10)
    q.settle(True, 10)
    assert (q.here, q.there) == (0, 1000)


def test_a_negative_factor_is_refused():
    with pytest.raises(ConfigError, match="--decode-local-prefill"):
        PdConfig(decode_local_prefill=-1.0)


def test_a_pace_prices_each_side_by_its_ms_per_token():
    # here: 256 tokens at 3 ms = 768 ms; there: (300 + 256) at 1.5 ms = 834 ms
    pace = LocalPace(here_ms=3.0, there_ms=1.5)
    assert computes_here(here=0, there=300, prompt=256, factor=1.0, limit=0, pace=pace)
    # (256 + 256) * 3 = 1536 ms is not < 834 ms
    assert not computes_here(here=256, there=300, prompt=256, factor=1.0, limit=0, pace=pace)
    assert not computes_here(here=0, there=10**9, prompt=1, factor=0.0, limit=0, pace=pace)


def test_a_paced_local_queue_has_no_token_limit():
    # The limit bounds an unpriced queue only: 2000 local tokens wait 2304 * 1 ms here against
    # (4000 + 256) * 1 ms there.
    pace = LocalPace(here_ms=1.0, there_ms=1.0)
    assert computes_here(here=2048, there=4000, prompt=256, factor=1.0, limit=512, pace=pace)
    assert not computes_here(here=2048, there=4000, prompt=256, factor=1.0, limit=512)


def test_the_pace_comes_from_the_fitted_step_cost():
    cost = StepCost(a=20.0, b=1.0, c=2.0)
    # here: a step of 8 rows and 44 tokens costs 20 + 44 + 16 = 80 ms; there: 20 + 512 ms
    pace = LocalPace.of(cost, decode_rows=8, budget=44, chunk=512)
    assert pace.here_ms == pytest.approx(80 / 44)
    assert pace.there_ms == pytest.approx(532 / 512)
    # Nothing decoding: a whole chunk, the same price as the prefill worker's.
    idle = LocalPace.of(cost, decode_rows=0, budget=512, chunk=512)
    assert idle.here_ms == idle.there_ms


def test_claims_with_a_pace_balance_the_waits():
    q = PendingPrompts(1.0, limit=256)
    pace = LocalPace(here_ms=2.0, there_ms=1.0)
    where = [q.claim(256, lambda _remote: pace) for _ in range(9)]
    # a local token costs twice: about one prompt in three here, past the unpaced limit
    assert where.count(True) == 3
    assert q.here * 2 <= q.there + 256


def test_the_price_sees_the_remote_prompts_claimed_so_far():
    q = PendingPrompts(1.0)
    seen: list[int] = []

    def price(remote: int) -> LocalPace:
        seen.append(remote)
        return LocalPace(here_ms=1.0 + remote, there_ms=1.5)

    where = [q.claim(100, price) for _ in range(4)]
    # here 100 * 1 < 100 * 1.5; then 200 * 1 is not < 150; 200 * 2 not < 300; 200 * 3 not < 450
    assert where == [True, False, False, False]
    assert seen == [0, 0, 1, 2]
    assert q.remote == 3
    q.settle(False, 100)
    assert q.remote == 2
