"""A decode worker's choice between its prefill worker and its own steps for a prompt
(kvfence/pd/local_prefill.py): the arithmetic and the counters, no engine, no clock."""

from __future__ import annotations

import pytest

from kvfence.config import ConfigError, PdConfig
from kvfence.pd.local_prefill import PendingPrompts, computes_here


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
    sink(1)
    sink(2)
    assert seen == [1, 2]
    assert (q.here, q.there) == (0, 0)


def test_settle_undoes_a_refused_claim():
    q = PendingPrompts(2.0)
    q.there = 1000
    assert q.claim(10)
    q.settle(True, 10)
    assert (q.here, q.there) == (0, 1000)


def test_a_negative_factor_is_refused():
    with pytest.raises(ConfigError, match="--decode-local-prefill"):
        PdConfig(decode_local_prefill=-1.0)
