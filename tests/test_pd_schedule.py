"""How the PD roles schedule beside each other (Scheduler.share_prompts): the waiting prompts
that can still meet the TTFT target enter first, RESERVEs are never held behind a decode's own
prompt, and a decode worker that takes prompts keeps its floors within two TPOT targets. The
arithmetic with made-up costs and times, and the scheduler on a real pool with no model and no
clock read."""

from __future__ import annotations

import dataclasses

import torch

from kvfence.engine.admission import Admitted
from kvfence.engine.deadlines import OVERDUE_X, on_time_first
from kvfence.engine.request import GenerateRequest, SamplingParams
from kvfence.engine.scheduler import Scheduler, SchedulerLimits
from kvfence.engine.sequence import SeqMode, SeqStatus, Sequence
from kvfence.engine.step_budget import BudgetPolicy, Deadlines, StepBudget, StepCost, prefill_budget
from kvfence.kv.pool import KVPool

COST = StepCost(a=20.0, b=2.0, c=4.0)  # ms: fixed, per prefill token, per decode row


# ---- on_time_first: the order prompts enter in -------------------------------------------------


def test_prompts_that_can_still_be_on_time_go_first_in_arrival_order() -> None:
    # 1 ms a token, 100 tokens running ahead: the first prompt (300 tokens) would be done at
    # 400 ms with 350 left, late; the second at 100 + 200 = 300 < 900 (the late one's tokens
    # do not count: it goes after); the third at 300 + 100 = 400 < 500.
    prompts = [(300, 350.0), (200, 900.0), (100, 500.0)]
    assert on_time_first(100, 1.0, prompts) == ([1, 2, 0], 2)


def test_on_time_prompts_count_the_ones_before_them() -> None:
    # Each alone would be on time (100 ms of work, 150 left); behind the first, the second is
    # done at 200 ms: late.
    assert on_time_first(0, 1.0, [(100, 150.0), (100, 150.0)]) == ([0, 1], 1)


def test_before_a_fit_any_prompt_with_time_left_is_on_time() -> None:
    assert on_time_first(10_000, 0.0, [(256, -1.0), (256, 5.0), (256, 0.0)]) == ([1, 0, 2], 1)


def test_all_on_time_or_all_late_keeps_arrival_order() -> None:
    assert on_time_first(0, 1.0, [(1, 10.0), (1, 10.0), (1, 10.0)]) == ([0, 1, 2], 3)
    assert on_time_first(0, 1.0, [(50, 10.0), (50, 10.0)]) == ([0, 1], 0)


def test_an_overdue_prompt_goes_first_and_its_tokens_count_ahead() -> None:
    # 1 s target, overdue at 1 s late. The first is 1.2 s late: it leads, and its 300 tokens
    # run before the others: the second (100 more, 350 left) is then late; the third is just
    # late (not overdue) and stays behind.
    prompts = [(300, -1200.0), (100, 350.0), (100, -10.0), (10, 900.0)]
    assert on_time_first(0, 1.0, prompts, overdue_ms=1000.0) == ([0, 3, 1, 2], 2)
    # Without the bound the same prompts put the 1.2 s-late one last, however late it gets.
    assert on_time_first(0, 1.0, prompts) == ([1, 3, 0, 2], 2)


# ---- a decode worker's floors, held to two TPOT targets -----------------------------------------


def held(policy: BudgetPolicy) -> BudgetPolicy:
    return dataclasses.replace(policy, tpot_over_floors=True)


def test_a_decode_that_takes_prompts_keeps_its_floors_within_two_tpot_targets() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=64, target_tpot_ms=50.0)
    late = Deadlines(tpot_slack_ms=0.0)
    # 24 rows: a 116 ms decode-only step, already past the target: no room; the minimum chunk
    # (64 tokens, +128 ms) alone would make a 244 ms step.
    assert prefill_budget(policy, COST, 24, deadlines=late) == 64
    assert prefill_budget(held(policy), COST, 24, deadlines=late) == 1  # at least one token
    # 4 rows: a 36 ms step; two targets leave (100 - 36) / 2 = 32 tokens of the floor's 64.
    assert prefill_budget(held(policy), COST, 4, deadlines=late) == 32
    # A floor within two targets is untouched: 16 tokens -> a 68 ms step.
    small = dataclasses.replace(policy, min_chunk=16)
    assert prefill_budget(held(small), COST, 4, deadlines=late) == 16
    # The TPOT target's own room is never cut: a stream on pace, (50 - 36) / 2 = 7 tokens.
    none = dataclasses.replace(policy, min_chunk=1)
    assert prefill_budget(held(none), COST, 4, deadlines=Deadlines(50.0)) == 7


def test_the_prompts_ttft_floor_is_held_too() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=1, target_tpot_ms=50.0, target_ttft_ms=4000)
    urgent = Deadlines(tpot_slack_ms=50.0, prompts=((2048, 4500.0),))
    assert prefill_budget(policy, COST, 4, deadlines=urgent) > 32
    assert prefill_budget(held(policy), COST, 4, deadlines=urgent) == 32


def test_without_a_tpot_target_the_hold_changes_nothing() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=64, target_ttft_ms=4000)
    deadlines = Deadlines(prompts=((2048, 4500.0),))
    assert prefill_budget(held(policy), COST, 24, deadlines=deadlines) == prefill_budget(
        policy, COST, 24, deadlines=deadlines
    )


def test_a_held_decode_prices_its_prompts_at_the_steps_it_will_run() -> None:
    policy = BudgetPolicy(max_chunk=512, min_chunk=64, target_tpot_ms=50.0)
    # What a step of 24 rows really gives its prompts (see above), not the auto target's
    # 2 x 116 ms step: (232 - 116) / 2 = 58, lifted to the 64-token floor.
    assert StepBudget(policy).at_target(COST, 24) == 64
    assert StepBudget(held(policy)).at_target(COST, 24) == 1
    assert StepBudget(held(policy)).at_target(COST, 4) == 32


# ---- the scheduler on a pool -------------------------------------------------------------------


def make_sched(ttft: float | None = 1000.0, chunk: int = 64) -> Scheduler:
    pool = KVPool(
        num_layers=1, num_pages=256, page_size=4, num_kv_heads=1, head_dim=2,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    policy = BudgetPolicy(
        max_chunk=chunk, min_chunk=8, target_tpot_ms=50.0, target_ttft_ms=ttft, backlog_steps=0
    )
    return Scheduler(pool, SchedulerLimits(chunk, 64, policy))


def make_seq(rid: str, n: int, arrived: float, mode: SeqMode = SeqMode.FULL) -> Sequence:
    req = GenerateRequest(rid, "t", tuple(range(1, n + 1)), SamplingParams(max_tokens=4))
    seq = Sequence(Admitted(req, 4), lambda _out: None, mode, None)  # type: ignore[arg-type]
    seq.token_ids = list(req.prompt_token_ids)
    seq.arrived = arrived
    return seq


def entered(sched: Scheduler, now: float) -> list[str]:
    return [c.seq.request_id for c in sched.schedule(now) if c.length > 0]


def test_a_pd_role_computes_a_prompt_that_can_be_on_time_before_a_late_one() -> None:
    for share in (False, True):
        sched = make_sched()
        if share:
            sched.share_prompts(hold_tpot=False)
        # At t = 10 s with a 1 s target: the first arrived 1.5 s ago (late, not yet overdue),
        # the second 0.1 s ago.
        sched.add(make_seq("late", 40, arrived=8.5))
        sched.add(make_seq("fresh", 40, arrived=9.9))
        first = entered(sched, now=10.0)
        # Shared: the fresh one alone (the late one's tokens would only delay its first
        # token); a unified engine keeps arrival order and fills the chunk.
        assert first == (["fresh"] if share else ["late", "fresh"]), share


def test_later_arrivals_pass_a_late_prompt_over_for_at_most_overdue_x_targets() -> None:
    # The bound on starvation: under load fresh prompts keep arriving, each able to be on time.
    # A late prompt gives way to them only until it is OVERDUE_X targets past its own target.
    for late_by, first in ((0.5, "fresh"), (OVERDUE_X + 0.01, "late")):
        sched = make_sched()
        sched.share_prompts(hold_tpot=False)
        sched.add(make_seq("late", 40, arrived=10.0 - 1.0 - late_by))
        sched.add(make_seq("fresh", 40, arrived=9.9))
        assert entered(sched, now=10.0)[0] == first, late_by


def test_a_late_prompt_still_enters_a_step_with_nothing_on_time() -> None:
    sched = make_sched()
    sched.share_prompts(hold_tpot=False)
    sched.add(make_seq("late", 40, arrived=8.0))
    assert entered(sched, now=10.0) == ["late"]


def test_without_a_ttft_target_a_pd_role_keeps_arrival_order() -> None:
    sched = make_sched(ttft=None)
    sched.share_prompts(hold_tpot=False)
    sched.add(make_seq("a", 40, arrived=8.0))
    sched.add(make_seq("b", 40, arrived=9.9))
    assert entered(sched, now=10.0) == ["a", "b"]


def test_reserves_enter_while_the_decodes_own_prompt_takes_the_whole_budget() -> None:
    sched = make_sched(ttft=None)
    own = make_seq("own", 200, arrived=0.0)
    sched.add(own)
    assert entered(sched, now=0.0) == ["own"]  # a whole 64-token chunk: no row decodes
    reserve = make_seq("reserve", 40, arrived=0.1, mode=SeqMode.DECODE_ONLY)
    sched.add(reserve)
    # The prompt's next chunk takes every token the step has (no decode rows: 64).
    assert entered(sched, now=0.2) == ["own"]
    # ... and the RESERVE got its pages all the same: its KV comes from the prefill worker.
    assert reserve.status is SeqStatus.HANDOFF and sched.reserved == [reserve]
    assert not sched.waiting


def test_share_prompts_holds_only_a_decode_that_takes_prompts() -> None:
    sched = make_sched()
    sched.share_prompts(hold_tpot=False)
    assert sched.limits.on_time_first and not sched.step_budget.policy.tpot_over_floors
    sched.share_prompts(hold_tpot=True)
    assert sched.step_budget.policy.tpot_over_floors
    assert sched.limits.step is sched.step_budget.policy  # one policy, read in both places
