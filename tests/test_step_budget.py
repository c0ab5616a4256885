"""The step-time budget's arithmetic (kvfence/engine/step_budget.py): the fit of step cost on
synthetic steps, and the prefill budget it implies. No clocks: every time here is made up."""

from __future__ import annotations

import random

import pytest

from kvfence.engine.step_budget import (
    AUTO_STEP_FACTOR,
    MIN_SAMPLES,
    NARROW_ROWS,
    WIDE_ROWS,
    ArrivalPace,
    BudgetPolicy,
    StepBudget,
    StepCost,
    auto_factor,
    fit_nonnegative,
    fit_robust,
    prefill_budget,
)

COST = StepCost(a=20.0, b=1.25, c=4.0)  # ms: fixed, per prefill token, per decode row


def steps(
    cost: StepCost, n: int, seed: int = 0, noise: float = 0.0
) -> list[tuple[int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p, d = rng.choice([0, 16, 64, 200, 512]), rng.randrange(0, 33)
        if p == 0 and d == 0:
            d = 1
        out.append((p, d, cost.predict(p, d) * (1 + rng.uniform(-noise, noise))))
    return out


def test_fit_recovers_the_coefficients_of_exact_steps() -> None:
    got = fit_nonnegative(steps(COST, 40))
    assert got is not None
    assert got.a == pytest.approx(COST.a, rel=1e-6)
    assert got.b == pytest.approx(COST.b, rel=1e-6)
    assert got.c == pytest.approx(COST.c, rel=1e-6)


def test_fit_keeps_every_coefficient_non_negative() -> None:
    # Steps whose plain least squares has a negative intercept: the fit holds it at 0.
    rows = [(100, 0, 90.0), (200, 0, 190.0), (400, 0, 390.0), (0, 8, 30.0), (0, 16, 60.0)]
    got = fit_nonnegative(rows)
    assert got is not None
    assert got.a >= 0 and got.b > 0 and got.c >= 0
    assert got.predict(200, 0) == pytest.approx(190.0, rel=0.1)


def test_fit_without_prefill_steps_is_none() -> None:
    # Nothing says what a prefill token costs: no budget can follow from these steps.
    assert fit_nonnegative([(0, d, 10.0 + 3 * d) for d in range(1, 20)]) is None
    assert fit_nonnegative([]) is None


def test_robust_fit_ignores_a_few_stalled_steps() -> None:
    rows = steps(COST, 60, seed=1, noise=0.02)
    stalled = [(p, d, ms * 20) for p, d, ms in rows[:5]]  # a neighbour's burst on the cores
    got = fit_robust(stalled + rows[5:])
    plain = fit_nonnegative(stalled + rows[5:])
    assert got is not None and plain is not None
    assert got.b == pytest.approx(COST.b, rel=0.1)
    assert got.predict(0, 8) == pytest.approx(COST.predict(0, 8), rel=0.1)
    assert abs(plain.predict(0, 8) - COST.predict(0, 8)) > abs(
        got.predict(0, 8) - COST.predict(0, 8)
    )


def test_budget_from_an_absolute_target() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=16, max_decode_step_ms=120.0)
    # 8 rows decode in 20 + 32 = 52 ms; 68 ms left at 1.25 ms a token is 54 tokens.
    assert prefill_budget(policy, COST, 8) == 54
    # 32 rows: 148 ms, over the target already: the minimum chunk still goes.
    assert prefill_budget(policy, COST, 32) == 16


def test_budget_from_the_auto_target_scales_with_the_decode_step() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=1)
    for rows in (1, 8, 32):
        decode_ms = COST.predict(0, rows)
        want = int((AUTO_STEP_FACTOR - 1) * decode_ms / COST.b)
        assert prefill_budget(policy, COST, rows) == want
    # A machine twice as slow in every respect gets the same budget.
    slow = StepCost(COST.a * 2, COST.b * 2, COST.c * 2)
    assert prefill_budget(policy, slow, 8) == prefill_budget(policy, COST, 8)


def test_the_auto_factor_rises_from_narrow_to_wide_batches() -> None:
    wide = BudgetPolicy(max_chunk=4096, min_chunk=1, wide_factor=6.0)
    assert [auto_factor(wide, r) for r in (0, 1, NARROW_ROWS)] == [AUTO_STEP_FACTOR] * 3
    assert auto_factor(wide, WIDE_ROWS) == auto_factor(wide, 4 * WIDE_ROWS) == 6.0
    mid = (NARROW_ROWS + WIDE_ROWS) // 2
    assert auto_factor(wide, mid) == pytest.approx((AUTO_STEP_FACTOR + 6.0) / 2)
    # The budget follows: (factor - 1) x the decode-only step, in prefill tokens.
    decode_ms = COST.predict(0, WIDE_ROWS)
    assert prefill_budget(wide, COST, WIDE_ROWS) == int(5.0 * decode_ms / COST.b)
    # The default (2x at every width) and an absolute target ignore the factor.
    plain = BudgetPolicy(max_chunk=4096, min_chunk=1)
    assert prefill_budget(plain, COST, WIDE_ROWS) == int(decode_ms / COST.b)
    fixed = BudgetPolicy(max_chunk=4096, min_chunk=1, max_decode_step_ms=300.0, wide_factor=6.0)
    assert prefill_budget(fixed, COST, WIDE_ROWS) == int((300.0 - decode_ms) / COST.b)


def test_budget_bounds_min_cap_and_chunk() -> None:
    cheap = StepCost(a=100.0, b=0.01, c=0.0)  # the target leaves room for 10,000 tokens
    assert prefill_budget(BudgetPolicy(512, 16), cheap, 4) == 512  # never above the chunk
    assert prefill_budget(BudgetPolicy(512, 16, token_cap=64), cheap, 4) == 64  # the cap wins
    costly = StepCost(a=0.0, b=100.0, c=100.0)  # no room at all
    assert prefill_budget(BudgetPolicy(512, 24), costly, 4) == 24  # the floor
    assert prefill_budget(BudgetPolicy(512, 24, token_cap=8), costly, 4) == 8  # cap over floor


def test_budget_without_decodes_or_without_a_time_bound() -> None:
    assert prefill_budget(BudgetPolicy(512, 16, 50.0), COST, 0) == 512  # prefill alone: full
    assert prefill_budget(BudgetPolicy(512, 16, 0.0), COST, 8) == 512  # 0: no time bound
    assert prefill_budget(BudgetPolicy(512, 16, 0.0, token_cap=64), COST, 8) == 64  # cap only
    assert prefill_budget(BudgetPolicy(512, 16), None, 8) == 16  # nothing measured yet


def test_step_budget_learns_from_observed_steps() -> None:
    budget = StepBudget(BudgetPolicy(max_chunk=512, min_chunk=8, max_decode_step_ms=120.0))
    rows = steps(COST, MIN_SAMPLES - 1, seed=3)
    for p, d, ms in rows:
        budget.observe(p, d, ms)
    assert budget.for_step(8) == 8  # too few steps to trust: the minimum chunk
    budget.observe(0, 0, 5.0)  # an empty step says nothing and is not kept
    budget.observe(64, 0, float("nan"))  # nor is a broken clock reading
    assert budget.for_step(8) == 8
    for p, d, ms in steps(COST, 40, seed=4):
        budget.observe(p, d, ms)
    assert budget.for_step(8) == 54
    assert budget.for_step(0) == 512


def test_budget_takes_a_share_of_the_backlog() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=16, max_decode_step_ms=120.0, backlog_steps=16)
    assert prefill_budget(policy, COST, 8, backlog=256) == 54  # 16 a step: the target's 54 wins
    assert prefill_budget(policy, COST, 8, backlog=3200) == 200  # a burst drains in ~16 steps
    assert prefill_budget(policy, COST, 8, backlog=3201) == 201  # rounded up, never stalls
    assert prefill_budget(policy, COST, 8, backlog=100_000) == 512  # never above the chunk
    capped = BudgetPolicy(512, 16, 120.0, token_cap=64, backlog_steps=16)
    assert prefill_budget(capped, COST, 8, backlog=3200) == 64  # the cap over the backlog
    assert prefill_budget(policy, None, 8, backlog=3200) == 200  # before any measurement too


def test_arrival_pace_is_a_moving_average_of_tokens_per_step() -> None:
    pace = ArrivalPace(half_life_steps=1.0)  # alpha 1/2: easy to follow by hand
    pace.arrive(100)
    assert pace.tick() == pytest.approx(50.0)  # half of the 100 that arrived
    assert pace.tick() == pytest.approx(25.0)  # nothing arrived: it decays
    pace.arrive(30)
    pace.arrive(70)  # arrivals between two steps add up
    assert pace.tick() == pytest.approx(62.5)
    # A steady 32 tokens per step (a 256-token prompt every 8 steps) converges to 32.
    steady = ArrivalPace()
    for i in range(2000):
        if i % 8 == 0:
            steady.arrive(256)
        steady.tick()
    assert 28 <= steady.rate <= 36


def test_budget_keeps_pace_with_arrivals() -> None:
    # The time target leaves 16 tokens; arrivals of 40 per step at pace 1.25 lift it to 50,
    # above the minimum chunk and a backlog share; pace 0 leaves the arrival rate unused.
    policy = BudgetPolicy(512, 8, max_decode_step_ms=40.0, backlog_steps=64, pace=1.25)
    cost = StepCost(a=20.0, b=1.0, c=0.5)  # 8 rows: 24 ms; room (40 - 24) / 1 = 16
    assert prefill_budget(policy, cost, 8, backlog=256, arrival_rate=0.0) == 16
    assert prefill_budget(policy, cost, 8, backlog=256, arrival_rate=40.0) == 50
    off = BudgetPolicy(512, 8, max_decode_step_ms=40.0, backlog_steps=64, pace=0.0)
    assert prefill_budget(off, cost, 8, backlog=256, arrival_rate=40.0) == 16
    # Never past the operator's hard cap, and a step with no decode still takes a whole chunk.
    capped = BudgetPolicy(512, 8, max_decode_step_ms=40.0, token_cap=30, pace=1.25)
    assert prefill_budget(capped, cost, 8, arrival_rate=40.0) == 30
    assert prefill_budget(policy, cost, 0, arrival_rate=40.0) == 512


def test_step_budget_counts_arrivals_once_per_step() -> None:
    budget = StepBudget(BudgetPolicy(512, 1, pace=1.0))
    budget.arrive(1000)
    first = budget.for_step(decode_rows=4)  # no cost model yet: the floors decide
    assert first == pytest.approx(1000 * budget.pace.alpha, abs=1)
    assert budget.for_step(decode_rows=4) < first  # the arrival was counted once, then decays


def test_beside_is_the_last_step_at_its_target_without_floors() -> None:
    budget = StepBudget(
        BudgetPolicy(max_chunk=512, min_chunk=8, max_decode_step_ms=120.0, backlog_steps=2)
    )
    for p, d, ms in steps(COST, MIN_SAMPLES - 1, seed=3):
        budget.observe(p, d, ms)
    budget.for_step(8)
    assert budget.beside() is None  # nothing fit yet: nothing to price a prompt by
    for p, d, ms in steps(COST, 40, seed=4):
        budget.observe(p, d, ms)
    # (120 - 20 - 8 * 4) / 1.25 = 54 tokens, whatever the backlog floor gives this step
    assert budget.for_step(8, backlog=1000) == 500
    cost, rows = budget.beside()
    assert cost.b == pytest.approx(COST.b)
    assert (rows, budget.at_target(cost, rows)) == (8, 54)
    assert budget.at_target(cost, 0) == 512  # nothing decodes: a whole chunk


def test_seeds_fit_until_real_steps_can_then_leave_the_fit() -> None:
    """The boot warm-up's steps (seeds) price the first steps; once MIN_SAMPLES real steps were
    seen the fit is theirs alone, however far off the seeds were (a warm-up timed on a busy
    host)."""
    from kvfence.engine.step_budget import MIN_SAMPLES, StepCost, StepCostModel

    busy, real = StepCost(a=1000.0, b=5.0, c=40.0), StepCost(a=20.0, b=1.0, c=2.0)
    shapes = [(0, 1), (0, 8), (0, 32), (256, 0), (512, 0), (128, 8), (64, 32), (32, 1)]
    m = StepCostModel()
    for p, d in shapes:
        m.seed(p, d, busy.predict(p, d))
    seeded = m.cost()
    assert seeded is not None and seeded.a == pytest.approx(busy.a, rel=1e-6)
    for p, d in shapes[: MIN_SAMPLES - 1]:
        m.observe(p, d, real.predict(p, d))
        assert m.cost() is not None  # seeds and the real steps so far
    m.observe(*shapes[MIN_SAMPLES - 1], real.predict(*shapes[MIN_SAMPLES - 1]))
    fit = m.cost()
    assert fit is not None
    assert (fit.a, fit.b, fit.c) == pytest.approx((real.a, real.b, real.c), rel=1e-6)
