"""Waves (kvfence/engine/waves.py): with both latency targets set, prompts are computed while no
stream decodes and their first tokens come out together. The arithmetic with made-up costs and
times, then the engine's steps from a fixed cost model: what each step computes, never how long
it took."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from kvfence.engine.llm import LLM
from kvfence.engine.request import GenerateRequest, SamplingParams
from kvfence.engine.step_budget import StepCost, StepCostModel
from kvfence.engine.waves import (
    OVERDUE_X,
    Wave,
    cut,
    cut_order,
    cut_release,
    drain_ms,
    early_firsts,
    early_rest,
    fill_ms,
    mode,
    on_time,
)

COST = StepCost(a=10.0, b=1.0, c=5.0)  # ms: fixed, per prefill token, per decode row


def test_streams_drain_in_decode_only_steps_as_they_finish() -> None:
    # Two rows for 2 steps (20 ms each), then one row for 3 more (15 ms each).
    assert drain_ms(COST, [5, 2]) == pytest.approx(2 * 20 + 3 * 15)
    assert drain_ms(COST, []) == 0.0
    assert drain_ms(COST, [0, -1]) == 0.0


def test_a_fill_is_whole_chunks_and_the_release_step() -> None:
    # 600 tokens in chunks of 256: 3 steps, then the step that samples the held first tokens.
    assert fill_ms(COST, 600, 256) == pytest.approx(3 * 10 + 600 + 10)
    assert fill_ms(COST, 0, 256) == 0.0


def test_a_wave_is_on_time_when_its_tightest_prompt_is() -> None:
    assert on_time(COST, 256, 0.0, 600, min_left_ms=640.0)
    assert not on_time(COST, 256, 0.0, 600, min_left_ms=639.0)
    assert not on_time(COST, 256, 1.0, 600, min_left_ms=640.0)  # after a wait


def test_before_anything_is_measured_a_wave_forms_but_nothing_is_deferred() -> None:
    # A closed loop's first prompts arrive together: mixed, they would stagger the streams.
    assert mode(False, [], [(100, 1.0)], None, 256, False) is Wave.FILL
    assert mode(True, [], [(1, 1.0)], None, 256, True) is Wave.RELEASE
    assert mode(False, [5], [(100, 1e9)], None, 256, False) is Wave.OFF
    # Longer than the steps the fit needs (MIN_SAMPLES chunks): not started blind.
    assert mode(False, [], [(8 * 256, 1.0)], None, 256, False) is Wave.FILL
    assert mode(False, [], [(8 * 256 + 1, 1e9)], None, 256, False) is Wave.OFF
    assert mode(True, [], [(8 * 256 + 1, 1e9)], None, 256, False) is Wave.OFF


def test_with_no_stream_decoding_the_prompts_fill_a_wave() -> None:
    assert mode(False, [], [(100, 1e9), (300, 1e9)], COST, 256, False) is Wave.FILL
    assert mode(False, [], [], COST, 256, False) is Wave.OFF  # nothing to compute


def test_a_wave_too_big_for_the_ttft_target_is_not_formed() -> None:
    # 400 tokens: 2 steps + release = 420 ms; the tightest prompt has 419 left.
    assert mode(False, [], [(100, 1e9), (300, 419.0)], COST, 256, False) is Wave.OFF
    assert mode(True, [], [(100, 1e9), (300, 419.0)], COST, 256, False) is Wave.OFF


def test_a_waiting_prompt_waits_for_the_streams_while_it_stays_on_time() -> None:
    # Two streams drain in 85 ms; a 100-token wave then takes 120 ms.
    assert mode(False, [5, 2], [(100, 205.0)], COST, 256, False) is Wave.DEFER
    assert mode(False, [5, 2], [(100, 204.0)], COST, 256, False) is Wave.OFF


def test_a_filled_wave_is_released_and_a_stream_from_outside_ends_a_fill() -> None:
    assert mode(True, [], [(1, 1e9), (1, 1e9)], COST, 256, True) is Wave.RELEASE
    assert mode(True, [], [(1, 1e9), (40, 1e9)], COST, 256, False) is Wave.FILL
    assert mode(True, [3], [(1, 1e9)], COST, 256, False) is Wave.OFF


def test_the_wave_moves_prefill_out_of_the_streams_tpot() -> None:
    # The docstring's arithmetic, C=8, 256 -> 64: 8 prompts of 360 ms, decode steps of 35 ms.
    cost = StepCost(a=0.0, b=360.0 / 256, c=35.0 / 8)
    prefill, decode = 8 * cost.predict(256, 0), drain_ms(cost, [63] * 8)
    staggered = (prefill + decode) / 63  # every prompt rides in some stream's gaps
    assert staggered == pytest.approx(80.7, abs=0.1)
    assert decode / 63 == pytest.approx(35.0)  # in a wave: the decode step alone
    # The TTFT the wave costs the last prompt stays within a 4 s target.
    assert on_time(cost, 512, 0.0, 8 * 256, 4000.0)


def test_early_first_tokens_keep_the_wave_gaps_under_their_share() -> None:
    # 8 prompts of 64 out: 504 gaps, 4 may be long: the leader's and 3 early first tokens.
    assert early_firsts(COST, 256, 0, 8, 63, 100.0, early=0) == 3
    assert early_firsts(COST, 256, 0, 8, 63, 100.0, early=2) == 1
    assert early_firsts(COST, 256, 0, 8, 63, 100.0, early=3) == 0
    assert early_firsts(COST, 256, 0, 4, 3, 100.0, early=0) == 0  # too few gaps for one
    assert early_firsts(None, 256, 0, 8, 63, 100.0, early=0) == 0


def test_an_early_first_token_waits_only_for_a_rest_its_tpot_can_carry() -> None:
    # 8 rows decode in 50 ms; a 50 ms stream at 90% of a 100 ms target can carry
    # 63 x (90 - 50) = 2520 ms of the rest of the wave: 2,410 tokens (10 steps, release) fit.
    assert fill_ms(COST, 2410, 256) == pytest.approx(2520.0)
    assert early_firsts(COST, 256, 2410, 8, 63, 100.0, early=0) == 3
    assert early_firsts(COST, 256, 2411, 8, 63, 100.0, early=0) == 0


def test_a_fill_step_stops_where_early_first_tokens_may_come() -> None:
    # The same wave: early first tokens may come once at most 2,410 tokens are left.
    assert early_rest(COST, 256, 5000, 8, 63, 100.0, early=0) == 2410
    assert early_rest(COST, 256, 1000, 8, 63, 100.0, early=0) == 1000  # they may already
    assert early_rest(COST, 256, 5000, 8, 63, 100.0, early=3) == -1  # no long gap left
    assert early_rest(COST, 256, 5000, 8, 63, 45.0, early=0) == -1  # the decode step alone misses
    assert early_rest(None, 256, 5000, 8, 63, 100.0, early=0) == -1


def test_a_cut_takes_the_oldest_prompts_that_can_be_on_time_within_its_share() -> None:
    # 100 tokens: 120 ms alone. The one with 5 ms left can never be on time; of the others the
    # tightest (300 ms) goes first, and a second would need 220 ms > half of 300.
    prompts = [(100, 1000.0), (100, 300.0), (100, 5.0), (100, 600.0)]
    assert cut(COST, 256, prompts) == [1]
    # With more time both fit half of the tightest's (130 ms of 400), oldest first.
    assert cut(COST, 256, [(100, 1000.0), (100, 800.0)]) == [1, 0]
    assert cut(COST, 256, [(100, 5.0)]) == []  # nobody can be on time: no cut
    assert cut(None, 256, prompts) == []  # nothing measured yet


def test_a_cut_serves_overdue_prompts_first_then_its_own_then_the_rest() -> None:
    # The bound on passing a late prompt over: once it is OVERDUE_X targets late it goes first.
    overdue = -OVERDUE_X * 4000.0 - 1.0
    prompts = [(50, -100.0), (50, 3000.0), (50, overdue), (50, 2000.0)]
    assert cut_order(prompts, {1}, 4000.0) == [2, 1, 0, 3]
    assert cut_order(prompts, {1, 3}, 4000.0) == [2, 3, 1, 0]


def test_a_cut_ends_when_its_prompts_all_have_a_first_token_or_one_is_late() -> None:
    assert cut_release([])
    assert not cut_release([100.0, 5.0])
    assert cut_release([100.0, 0.0])


class FixedCost(StepCostModel):
    def cost(self) -> StepCost:
        return COST


def waves_llm(model_dir: str, ttft_ms: float, cache: bool = False, ttft_cuts: bool = False) -> LLM:
    """An engine with both targets set and COST for its step cost."""
    llm = LLM(
        model_dir,
        kv_pool_tokens=2048,
        chunked_prefill_size=64,
        enable_prefix_caching=cache,
        target_tpot_ms=50.0,
        target_ttft_ms=ttft_ms,
        ttft_cuts=ttft_cuts,
    )
    llm.engine.scheduler.step_budget.model = FixedCost()
    return llm


def run_steps(llm: LLM, prompts: list[list[int]], max_tokens: int):  # type: ignore[no-untyped-def]
    """Submit every prompt, step to the end; (per step: decode rows, prefill tokens, requests
    whose first token it made) and each request's tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.submit(
            GenerateRequest(str(i), "t", tuple(p), params),
            lambda o, i=i: outs[i].extend(o.new_token_ids),
        )
    steps = []
    while engine.has_work():
        assert len(steps) < 500, "the engine stopped making progress (a wave that never starts?)"
        before = {i: len(v) for i, v in outs.items()}
        chunks = []
        real = engine.runner.run

        def spy(cs, real=real, chunks=chunks):  # type: ignore[no-untyped-def]
            chunks.extend(cs)
            return real(cs)

        engine.runner.run = spy  # type: ignore[method-assign]
        engine.step()
        engine.runner.run = real  # type: ignore[method-assign]
        firsts = {i for i, v in outs.items() if before[i] == 0 and v}
        rows = sum(1 for c in chunks if c.seq.output_ids and c.length == 1)
        steps.append((rows, sum(c.length for c in chunks if not c.seq.output_ids), firsts))
    return steps, [outs[i] for i in range(len(prompts))]


def four_in_a_wave(model_dir: str, seed: int, max_tokens: int):  # type: ignore[no-untyped-def]
    """run_steps over four 40-token prompts, checking the answers against an engine without
    targets (holding a prompt's last token must change nothing, the prefix cache on as served:
    the pages a held prompt filled are sealed as any other's)."""
    prompts = random_prompts([40, 40, 40, 40], vocab=256, seed=seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    steps, got = run_steps(waves_llm(model_dir, 1e9, cache=True), prompts, max_tokens)
    assert got == want, "holding a prompt's last token changed an answer"
    return steps


def test_a_wave_holds_first_tokens_until_every_prompt_is_computed(checkpoint_dir) -> None:
    steps = four_in_a_wave(str(checkpoint_dir("llama")), seed=11, max_tokens=4)
    firsts = [f for _, _, f in steps if f]
    # The leader's first token at once, the other three's together, in the step after the fill.
    assert firsts == [{0}, {1, 2, 3}]
    release = next(n for n, (_, _, f) in enumerate(steps) if f == {1, 2, 3})
    # No prompt token is computed beside a decoding stream: the fill ran with no decode rows
    # (the leader waited), and after it every step only decodes.
    assert all(rows == 0 for rows, _, _ in steps[:release])
    assert all(p <= 3 for _, p, _ in steps[release:])  # only the held last tokens
    assert all(p == 0 for _, p, _ in steps[release + 1 :])


def test_a_prompt_arriving_beside_streams_waits_for_them_while_on_time(checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir("llama"))
    first, late = random_prompts([20, 30], vocab=256, seed=12)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for ttft, deferred in ((1e9, True), (1.0, False)):
        engine = waves_llm(model_dir, ttft).engine
        engine.submit(GenerateRequest("a", "t", tuple(first), params), lambda o: None)
        engine.step()  # a's prompt (a wave of one: its leader)
        engine.step()  # the wave is released: a decodes from now on
        engine.submit(GenerateRequest("b", "t", tuple(late), params), lambda o: None)
        engine.step()
        waiting = [s.request_id for s in engine.scheduler.waiting]
        # With time to spare b waits for a to finish; with none (the wave could not be on time)
        # the step budget takes it beside a's decode, as without targets.
        assert (waiting == ["b"]) is deferred, (ttft, waiting)


def test_a_wave_the_pool_cannot_grow_starts_with_what_it_holds(checkpoint_dir) -> None:
    # Two 60-token prompts fill the pool (4 of its 10 pages each); the third cannot enter until
    # one finishes. The fill must not wait for it: the wave starts, and the third follows.
    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([60, 60, 60], vocab=256, seed=13)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    llm = LLM(
        model_dir,
        context_length=128,
        kv_pool_tokens=160,
        page_size=16,
        chunked_prefill_size=64,
        enable_prefix_caching=False,
        target_tpot_ms=50.0,
        target_ttft_ms=1e9,
    )
    steps, got = run_steps(llm, prompts, 4)
    assert got == want
    assert [f for _, _, f in steps if f] == [{0}, {1}, {2}]


def test_with_enough_gaps_a_held_prompt_gets_its_first_token_early(checkpoint_dir) -> None:
    # 4 prompts x 63 more tokens: 252 gaps, 2 may be long (the leader's and one early first
    # token), and the rest of the wave is short enough for the early one's TPOT.
    steps = four_in_a_wave(str(checkpoint_dir("llama")), seed=14, max_tokens=64)
    assert [f for _, _, f in steps if f] == [{0}, {1}, {2, 3}]


def test_a_fill_step_stops_where_early_first_tokens_may_start_then_at_each_prompt() -> None:
    from types import SimpleNamespace

    from kvfence.engine.fill import Fill

    def seq(rid: str, left: int = 0, **kw: object) -> SimpleNamespace:
        base = dict(request_id=rid, output_ids=[], in_decode=False, num_uncomputed=left,
                    token_ids=[], admitted=SimpleNamespace(max_tokens=64))
        return SimpleNamespace(**(base | kw))

    def fill(left: int, early: int = 0, leader: bool = True) -> Fill:
        # A wave of 8: the leader, `early` early ones, one held, the rest computing.
        firsts = [seq(f"e{i}", output_ids=[1], in_decode=True) for i in range(leader + early)]
        computing = [seq(f"p{i}", left) for i in range(7 - len(firsts))]
        running = [*firsts, seq("held", in_decode=True), *computing]
        return Fill.of(running, [], firsts, {})  # type: ignore[arg-type]

    # 8 prompts x 63 more tokens at COST: early first tokens may come once 2,410 are left.
    # 6 x 499 = 2,994 are: the step stops 584 tokens on, where they may.
    assert fill(500).stop(COST, 256, 100.0, budget=1000) == 584
    assert fill(500).stop(COST, 256, 100.0, budget=256) == 256
    # Past that point: the next prompt's 299 tokens (its held one aside), then a first token.
    assert fill(300).stop(COST, 256, 100.0, budget=1000) == 299
    assert fill(300).firsts(COST, 256, 100.0)[0].request_id == "held"
    # The leader's step (the wave may still be arriving) and a wave out of long gaps: whole.
    assert fill(500, leader=False).stop(COST, 256, 100.0, budget=1000) == 1000
    assert fill(300, early=3).stop(COST, 256, 100.0, budget=1000) == 1000
    assert fill(300, early=3).firsts(COST, 256, 100.0) == []


class SlowPrefill(StepCostModel):
    def cost(self) -> StepCost:
        return StepCost(a=10.0, b=10.0, c=5.0)


def test_the_fill_step_that_gives_early_first_tokens_stops_where_they_may_come(
    checkpoint_dir,
) -> None:
    # 6 prompts x 63 more tokens: 2 early first tokens beside the leader's. A stream decodes in
    # 40 ms steps, so at 90% of 50 ms it can wait 315 ms for the rest of the wave: 29 tokens
    # at 10 ms (one step and the release). The step that passes that point stops at it, and
    # the two held prompts' first tokens come in it instead of after a whole chunk of 64.
    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([40] * 6, vocab=256, seed=17)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    llm = waves_llm(model_dir, 1e9)
    llm.engine.scheduler.step_budget.model = SlowPrefill()
    steps, got = run_steps(llm, prompts, 64)
    assert got == want, "a shorter fill step changed an answer"
    # Three steps fill (64-token chunks; the leader's first token in the first), then 43
    # tokens are left: a whole step would compute them all with the early first tokens, which
    # would then come 43 tokens' compute later than their target let them. It computes 15 and
    # leaves 28; the next step computes those, and the release follows.
    prefill = [p for _, p, _ in steps]
    firsts = [sorted(f) for _, _, f in steps]
    assert prefill[:6] == [24, 64, 64, 15, 28, 0], prefill[:6]
    assert firsts[:6] == [[0], [], [], [1, 2], [], [3, 4, 5]], firsts[:6]


def test_a_repeated_prompt_in_a_wave_reuses_the_first_ones_pages(checkpoint_dir) -> None:
    # The second copy waits for the first's pages (the prefix cache), which a fill computes
    # and seals like any step: the wave neither stalls nor computes them twice.
    model_dir = str(checkpoint_dir("llama"))
    same, other = random_prompts([40, 40], vocab=256, seed=15)
    prompts = [same, same, other]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    llm = waves_llm(model_dir, 1e9, cache=True)
    steps, got = run_steps(llm, prompts, 4)
    assert got == want
    assert sum(p for _, p, _ in steps) < 3 * 40, "the repeated prompt's pages were computed twice"


def test_a_cut_starts_its_prompts_first_and_holds_the_others_to_its_end(checkpoint_dir) -> None:
    # 2 x 50 + 16 x 10 tokens, chunks of 64, a 285 ms TTFT target at COST: one wave would take
    # 320 ms, so none forms; a cut takes what fits half of it (50 + 50 + 10: 140 ms). The clock
    # stands still (every prompt arrives at 0 and is scheduled at 0): the cut ends when its
    # prompts have their first tokens, not on time.
    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([50, 50] + [10] * 16, vocab=256, seed=16)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    llm = waves_llm(model_dir, 285.0, ttft_cuts=True)
    sched = llm.engine.scheduler
    add, schedule = sched.add, sched.schedule

    def at_zero(seq):  # type: ignore[no-untyped-def]
        seq.arrived = 0.0
        add(seq)

    sched.add = at_zero  # type: ignore[method-assign]
    sched.schedule = lambda now=0.0: schedule(0.0)  # type: ignore[method-assign]
    steps, got = run_steps(llm, prompts, 4)
    assert got == want, "holding a prompt's last token changed an answer"
    firsts = [f for _, _, f in steps if f]
    # Step 1: 50 of the first and 14 of the second; step 2: the second's and the third's last
    # tokens and two others', held; step 3 releases those two (the cut's prompts all had theirs).
    assert firsts[:3] == [{0}, {1, 2}, {3, 4}], firsts[:3]


def test_while_a_cuts_streams_decode_no_wave_forms() -> None:
    from types import SimpleNamespace

    from kvfence.engine.scheduler import Scheduler, SchedulerLimits
    from kvfence.engine.sequence import SeqMode, SeqStatus
    from kvfence.engine.step_budget import BudgetPolicy

    def seq(rid: str, **kw: object) -> SimpleNamespace:
        base = dict(request_id=rid, status=SeqStatus.RUNNING, mode=SeqMode.FULL, output_ids=[],
                    in_decode=False, num_uncomputed=0, num_output=0, token_ids=[], arrived=0.0,
                    admitted=SimpleNamespace(max_tokens=4))
        return SimpleNamespace(**(base | kw))

    policy = BudgetPolicy(64, 1, target_tpot_ms=50.0, target_ttft_ms=1e9, ttft_cuts=True)
    sched = Scheduler(None, SchedulerLimits(64, 8, policy))  # type: ignore[arg-type]
    sched.step_budget.model = FixedCost()
    stream = seq("a", output_ids=[1], num_output=1, in_decode=True)
    sched.running = [stream]  # type: ignore[list-item]
    sched.waiting.append(seq("b", status=SeqStatus.WAITING, token_ids=[0] * 40))  # type: ignore[arg-type]
    # a drains and a wave then computes b well within its target: b waits for a ...
    assert sched._wave([stream], now=0.0) is Wave.DEFER  # type: ignore[list-item]
    # ... unless a is a cut's stream: then the step budget serves b beside it (a wave waiting
    # for the cut's streams would hold back the prompts the cut left).
    sched._cut = {"a"}
    assert sched._wave([stream], now=0.0) is Wave.OFF  # type: ignore[list-item]
    sched.running = []
    assert sched._wave([], now=0.0) is Wave.FILL  # a finished: waves again
