"""Steps sized to hold a TPOT and a TTFT target together (kvfence/engine/deadlines.py and the
budget built on it): the arithmetic with made-up costs and times, no clock read anywhere."""

from __future__ import annotations

import pytest

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.deadlines import tpot_lost, tpot_slack_ms, tpot_step_ms, ttft_floor
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


def test_a_stream_has_lost_its_tpot_target_when_even_the_fastest_steps_come_too_late() -> None:
    # First token at 10 s, 20 out, 43 to come at a 50 ms target: the last is due by
    # 10 + 0.05 x 62 = 13.1 s.
    assert not tpot_lost(50.0, 10.0, 20, 43, fastest_ms=20.0, now=12.0)  # 12 + 0.86 s: on time
    assert tpot_lost(50.0, 10.0, 20, 43, fastest_ms=20.0, now=12.3)  # 12.3 + 0.86 s: past it
    # Fewer tokens to come leave less room to catch up; more leave more.
    assert not tpot_lost(50.0, 10.0, 20, 200, fastest_ms=20.0, now=12.3)
    # A stream on pace is never lost while a step can keep the target.
    assert not tpot_lost(50.0, 10.0, 20, 43, fastest_ms=50.0, now=10.0 + 0.05 * 19)


def test_once_every_stream_has_lost_its_tpot_target_the_target_bounds_no_step() -> None:
    # 8 rows, 52 ms a decode-only step: lost streams leave the step what it would take without
    # a target (the auto factor, 2 x 52 ms: (104 - 52) / 1.25 = 41 tokens), not the minimum
    # chunk their negative slack leaves.
    policy = BudgetPolicy(max_chunk=4096, min_chunk=1, target_tpot_ms=100.0)
    lost = Deadlines(tpot_slack_ms=-500.0, tpot_lost=True)
    assert step_target_ms(policy, 8, DECODE_8, lost) == 2 * DECODE_8
    assert prefill_budget(policy, COST, 8, deadlines=lost) == 41
    untargeted = BudgetPolicy(max_chunk=4096, min_chunk=1)
    assert prefill_budget(policy, COST, 8, deadlines=lost) == prefill_budget(untargeted, COST, 8)
    # As without the target: an absolute --max-decode-step-ms alone bounds the step.
    capped = BudgetPolicy(max_chunk=4096, min_chunk=1, target_tpot_ms=100.0, max_decode_step_ms=150)
    assert step_target_ms(capped, 8, DECODE_8, lost) == 150.0
    # One stream still on target keeps the bound: its slack.
    behind = Deadlines(tpot_slack_ms=-500.0)
    assert prefill_budget(policy, COST, 8, deadlines=behind) == 1
    # A decode worker's held steps keep theirs: its prompts have the prefill worker.
    held = BudgetPolicy(max_chunk=4096, min_chunk=1, target_tpot_ms=100.0, tpot_over_floors=True)
    assert prefill_budget(held, COST, 8, deadlines=lost) == 1


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
    stream = seq(first_token_at=9.0, num_output=5, output_ids=[1] * 5, in_decode=True,
                 admitted=SimpleNamespace(max_tokens=64))  # fmt: skip
    prefilling = seq(num_uncomputed=200, arrived=9.5)
    queued = seq(status=SeqStatus.WAITING, token_ids=[0] * 300, arrived=9.8)
    transferred = seq(status=SeqStatus.WAITING, mode=SeqMode.DECODE_ONLY, token_ids=[0] * 999)
    sched.running = [stream, prefilling]  # type: ignore[list-item]
    sched.waiting.extend([queued, transferred])  # type: ignore[list-item]
    got = sched._deadlines([stream], now=9.45)  # type: ignore[list-item]
    # The stream's 6th token is due at 9.0 + 5 * 0.1 = 9.5 s: 50 ms from now.
    assert got is not None and got.tpot_slack_ms == pytest.approx(50.0)
    assert not got.tpot_lost
    # A prompt whose KV arrives by transfer is not computed here: not among the prompts.
    assert got.prompts == (
        (200, pytest.approx(2050.0)),
        (500, pytest.approx(2350.0)),
    )
    off = Scheduler(None, SchedulerLimits(512, 8, BudgetPolicy(512, 1)))  # type: ignore[arg-type]
    assert off._deadlines([stream], now=9.45) is None  # type: ignore[list-item]


def test_the_scheduler_says_when_every_decoding_stream_has_lost_its_tpot_target() -> None:
    from types import SimpleNamespace

    from kvfence.engine.scheduler import Scheduler, SchedulerLimits
    from kvfence.engine.sequence import SeqStatus

    policy = BudgetPolicy(max_chunk=512, min_chunk=1, target_tpot_ms=50.0)
    sched = Scheduler(None, SchedulerLimits(512, 8, policy))  # type: ignore[arg-type]
    sched.step_budget.model.cost = lambda: StepCost(a=10.0, b=1.0, c=10.0)  # type: ignore[method-assign]

    def stream(first_at: float) -> SimpleNamespace:
        # 2 out of 4: 2 to come, the last due by first_at + 3 x 50 ms
        return SimpleNamespace(status=SeqStatus.RUNNING, first_token_at=first_at, num_output=2,
                               admitted=SimpleNamespace(max_tokens=4))  # fmt: skip

    lost, kept = stream(9.0), stream(9.62)
    # At 9.7 s: lost's last token was due at 9.15 s; kept's at 9.77 s, two decode-only steps
    # of the two rows (10 + 2 x 10 ms each) away.
    got = sched._deadlines([lost, kept], now=9.7)  # type: ignore[list-item]
    assert got is not None and not got.tpot_lost
    assert got.tpot_slack_ms == pytest.approx((9.62 - 9.7) * 1000 + 50 * 2)  # kept's alone
    got = sched._deadlines([lost], now=9.7)  # type: ignore[list-item]
    assert got is not None and got.tpot_lost
    got = sched._deadlines([], now=9.7)
    assert got is not None and not got.tpot_lost  # no stream: none lost


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
