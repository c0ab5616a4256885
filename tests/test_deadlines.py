"""Steps sized to hold a TPOT and a TTFT target together (kvfence/engine/deadlines.py and the
budget built on it): the arithmetic with made-up costs and times, no clock read anywhere."""

from __future__ import annotations

import pytest

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.deadlines import tpot_slack_ms, tpot_step_ms, ttft_floor
from kvfence.engine.step_budget import (
    BudgetPolicy,
    Deadlines,
    StepCost,
    prefill_budget,
    step_target_ms,
)

COST = StepCost(a=20.0, b=1.25, c=4.0)  # ms: fixed, per prefill token, per decode row
DECODE_8 = COST.predict(0, 8)  # 52 ms


def test_a_stream_on_pace_leaves_one_target_of_slack() -> None:
    # First token at t=10 s, 5 out, now 10.4 s: next is due at 10 + 5 * 0.1 = 10.5 s.
    assert tpot_slack_ms(100.0, [(10.0, 5)], now=10.4) == pytest.approx(100.0)


def test_a_stream_ahead_of_pace_banks_no_more_than_one_target() -> None:
    assert tpot_slack_ms(100.0, [(10.0, 50)], now=10.4) == 100.0


def test_the_tightest_stream_sets_the_slack() -> None:
    rows = [(10.0, 50), (10.0, 5), (10.2, 3)]  # the third is due at 10.5 s, 40 ms behind pace
    assert tpot_slack_ms(100.0, rows, now=10.46) == pytest.approx(40.0)


def test_a_step_is_never_shorter_than_its_decodes() -> None:
    assert tpot_step_ms(100.0, slack_ms=-30.0, decode_ms=52.0) == 52.0
    assert tpot_step_ms(100.0, slack_ms=70.0, decode_ms=52.0) == 70.0
    assert tpot_step_ms(100.0, slack_ms=500.0, decode_ms=52.0) == 100.0


def test_ttft_floor_finishes_each_prompt_by_its_deadline() -> None:
    # One prompt of 512 tokens, 2 s left, steps of 52 ms + 1.25 ms per token:
    # t >= 512 * 52 / (2000 - 512 * 1.25) = 19.6 -> 20 tokens a step.
    assert ttft_floor(DECODE_8, COST.b, [(512, 2000.0)], cap=512) == 20
    t = 20
    steps = 2000.0 / (DECODE_8 + COST.b * t)
    assert steps * t >= 512  # on time at that size
    assert ttft_floor(DECODE_8, COST.b, [(512, 2000.0)], cap=512) > ttft_floor(
        DECODE_8, COST.b, [(512, 4000.0)], cap=512
    )


def test_ttft_floor_reads_every_prompt_in_serving_order() -> None:
    # The second prompt has less time left for more tokens: it sets the floor.
    both = [(256, 3000.0), (768, 1500.0)]
    assert ttft_floor(DECODE_8, COST.b, both, cap=4096) == ttft_floor(
        DECODE_8, COST.b, both[1:], cap=4096
    )


def test_a_prompt_that_cannot_be_on_time_asks_for_nothing_but_counts_for_those_behind() -> None:
    assert ttft_floor(DECODE_8, COST.b, [(512, -5.0)], cap=300) == 0
    assert ttft_floor(DECODE_8, COST.b, [(512, 600.0)], cap=300) == 0  # 512 * 1.25 > 600
    behind = [(512, 600.0), (768, 3000.0)]  # the second waits for the first's 512 tokens too
    assert ttft_floor(DECODE_8, COST.b, behind, cap=4096) == ttft_floor(
        DECODE_8, COST.b, [(768, 3000.0)], cap=4096
    )
    assert ttft_floor(DECODE_8, COST.b, [(10, 10_000.0), (10_000, 13_000.0)], cap=300) == 300


def test_the_tpot_target_bounds_a_mixed_step() -> None:
    policy = BudgetPolicy(max_chunk=4096, min_chunk=1, target_tpot_ms=100.0)
    on_pace = Deadlines(tpot_slack_ms=100.0)
    # (100 - 52) / 1.25 = 38 tokens beside 8 decodes.
    assert prefill_budget(policy, COST, 8, deadlines=on_pace) == 38
    behind = Deadlines(tpot_slack_ms=10.0)
    assert prefill_budget(policy, COST, 8, deadlines=behind) == 1  # the minimum chunk only
    both = BudgetPolicy(max_chunk=4096, min_chunk=1, target_tpot_ms=100.0, max_decode_step_ms=70)
    assert step_target_ms(both, 8, DECODE_8, on_pace) == 70.0


def test_the_ttft_floor_wins_over_the_tpot_target() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=1, target_tpot_ms=60.0, target_ttft_ms=1000)
    urgent = Deadlines(tpot_slack_ms=60.0, prompts=((512, 900.0),))
    calm = Deadlines(tpot_slack_ms=60.0)
    assert prefill_budget(policy, COST, 8, deadlines=calm) == 6  # (60 - 52) / 1.25
    assert prefill_budget(policy, COST, 8, deadlines=urgent) == ttft_floor(
        DECODE_8, COST.b, [(512, 900.0)], 512
    )
    assert prefill_budget(policy, COST, 8, deadlines=urgent) > 6


def test_without_targets_the_budget_is_unchanged() -> None:
    policy = BudgetPolicy(max_chunk=4096, min_chunk=1)
    assert prefill_budget(policy, COST, 8, deadlines=Deadlines()) == prefill_budget(
        policy, COST, 8
    )


def test_targets_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="--target-tpot-ms"):
        EngineConfig(model="m", target_tpot_ms=0.0)
    with pytest.raises(ConfigError, match="--target-ttft-ms"):
        EngineConfig(model="m", target_ttft_ms=-1.0)


def test_the_scheduler_measures_streams_and_prompts_against_the_targets() -> None:
    from types import SimpleNamespace

    from kvfence.engine.scheduler import Scheduler, SchedulerLimits
    from kvfence.engine.sequence import SeqMode, SeqStatus

    def seq(**kw: object) -> SimpleNamespace:
        base = dict(status=SeqStatus.RUNNING, mode=SeqMode.FULL, first_token_at=None,
                    output_ids=[], in_decode=False, num_uncomputed=0, token_ids=[], arrived=0.0)
        return SimpleNamespace(**(base | kw))

    policy = BudgetPolicy(max_chunk=512, min_chunk=1, target_tpot_ms=100.0, target_ttft_ms=2000)
    sched = Scheduler(None, SchedulerLimits(512, 8, policy))  # type: ignore[arg-type]
    stream = seq(first_token_at=9.0, num_output=5, output_ids=[1] * 5, in_decode=True)
    prefilling = seq(num_uncomputed=200, arrived=9.5)
    queued = seq(status=SeqStatus.WAITING, token_ids=[0] * 300, arrived=9.8)
    transferred = seq(status=SeqStatus.WAITING, mode=SeqMode.DECODE_ONLY, token_ids=[0] * 999)
    sched.running = [stream, prefilling]  # type: ignore[list-item]
    sched.waiting.extend([queued, transferred])  # type: ignore[list-item]
    got = sched._deadlines([stream], now=9.45)  # type: ignore[list-item]
    # The stream's 6th token is due at 9.0 + 5 * 0.1 = 9.5 s: 50 ms from now.
    assert got is not None and got.tpot_slack_ms == pytest.approx(50.0)
    # A prompt whose KV arrives by transfer is not computed here: not among the prompts.
    assert got.prompts == (
        (200, pytest.approx(2050.0)),
        (500, pytest.approx(2350.0)),
    )
    off = Scheduler(None, SchedulerLimits(512, 8, BudgetPolicy(512, 1)))  # type: ignore[arg-type]
    assert off._deadlines([stream], now=9.45) is None  # type: ignore[list-item]


def test_streams_whose_kv_is_arriving_bound_a_step_as_decoding_ones() -> None:
    from types import SimpleNamespace

    from kvfence.engine.scheduler import Scheduler, SchedulerLimits
    from kvfence.engine.sequence import SeqMode

    pool = SimpleNamespace(expire_prefix=lambda: None)
    sched = Scheduler(pool, SchedulerLimits(512, 8, BudgetPolicy(512, 1)))  # type: ignore[arg-type]
    asked: list[int] = []
    sched.step_budget.for_step = lambda rows, *_: asked.append(rows) or 0  # type: ignore[method-assign]
    arriving = SimpleNamespace(mode=SeqMode.DECODE_ONLY, output_ids=[])
    sent = SimpleNamespace(mode=SeqMode.PREFILL_ONLY, output_ids=[7])  # prefill's, never decodes
    sched.handoff = {"a": arriving, "b": sent}  # type: ignore[dict-item]
    sched.schedule()
    assert asked == [1]


def test_a_decode_does_not_count_prompts_arriving_by_transfer_as_its_backlog() -> None:
    from types import SimpleNamespace

    from kvfence.engine.scheduler import Scheduler, SchedulerLimits
    from kvfence.engine.sequence import SeqMode

    sched = Scheduler(None, SchedulerLimits(512, 8, BudgetPolicy(512, 1)))  # type: ignore[arg-type]
    mine = SimpleNamespace(mode=SeqMode.FULL, output_ids=[], token_ids=[0] * 300)
    sent = SimpleNamespace(mode=SeqMode.DECODE_ONLY, output_ids=[], token_ids=[0] * 999)
    sched.waiting.extend([mine, sent])  # type: ignore[list-item]
    assert sched._backlog() == 300
