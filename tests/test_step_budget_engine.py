"""The step-time budget inside the engine: a step that decodes carries the prefill the time target
leaves room for (from a fixed cost model here, so nothing depends on this machine's speed), a
step with no decode takes a whole chunk, a cached prefix is not charged, answers do not change,
and the engine feeds every step's time to the model."""

from __future__ import annotations

from conftest import random_prompts

from kvfence.engine.llm import LLM
from kvfence.engine.request import GenerateRequest, SamplingParams
from kvfence.engine.step_budget import StepCost, StepCostModel

# 1 decode row: 10 + 5 = 15 ms; a 100 ms target leaves 85 ms = 42 prefill tokens at 2 ms each.
COST = StepCost(a=10.0, b=2.0, c=5.0)
BUDGET_AT_ONE_ROW = 42


class FixedCost(StepCostModel):
    """Records steps like the real model but always predicts COST."""

    def cost(self) -> StepCost:
        return COST


def spy_steps(llm: LLM) -> list[tuple[int, int]]:
    """(decode rows, prefill tokens) of every step the engine runs from now on."""
    seen: list[tuple[int, int]] = []
    real = llm.engine.runner.run

    def spy(chunks):  # type: ignore[no-untyped-def]
        decodes = sum(c.seq.in_decode for c in chunks)
        seen.append((decodes, sum(c.length for c in chunks if not c.seq.in_decode)))
        return real(chunks)

    llm.engine.runner.run = spy  # type: ignore[method-assign]
    return seen


def test_time_target_sizes_prefill_beside_decodes(checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([10, 200], vocab=256, seed=5)
    # a decodes 3 steps beside b's prompt (3 x 42 tokens), then b's rest runs alone (64 + 10).
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=2048).generate(prompts, params)]
    llm = LLM(
        model_dir,
        kv_pool_tokens=2048,
        chunked_prefill_size=64,
        max_decode_step_ms=100.0,
        min_prefill_chunk=4,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    engine.scheduler.step_budget.model = FixedCost()
    seen = spy_steps(llm)
    outs: dict[str, list[int]] = {"a": [], "b": []}

    def submit(rid: str, prompt: list[int]) -> None:
        sink = outs[rid].extend
        engine.submit(
            GenerateRequest(rid, "t", tuple(prompt), params), lambda o: sink(o.new_token_ids)
        )

    submit("a", prompts[0])
    engine.step()  # a's prompt alone
    submit("b", prompts[1])
    while engine.scheduler.has_work():
        engine.step()
    assert [outs["a"], outs["b"]] == want
    with_decode = [p for d, p in seen if d == 1 and p]
    assert with_decode and max(with_decode) == BUDGET_AT_ONE_ROW
    assert [p for d, p in seen if not d and p] == [10, 64, 10]  # alone: whole 64-token chunks
    # Every step that ran was measured and handed to the model.
    assert len(engine.scheduler.step_budget.model.steps) == min(len(seen), 64)


def test_a_cached_prefix_is_not_charged_to_the_budget(checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir("llama"))
    shared, tail, other = random_prompts([96, 20, 12], vocab=256, seed=9)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(
        model_dir,
        kv_pool_tokens=2048,
        chunked_prefill_size=256,
        max_decode_step_ms=100.0,
        min_prefill_chunk=4,
    )
    engine = llm.engine
    engine.scheduler.step_budget.model = FixedCost()
    llm.generate([shared + [7]], params)  # seals the 96-token prefix (6 pages)
    seen = spy_steps(llm)
    cached: dict[str, int] = {}

    def submit(rid: str, prompt: list[int], max_tokens: int) -> None:
        p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.submit(
            GenerateRequest(rid, "default", tuple(prompt), p),  # LLM.generate's tenant
            lambda o: cached.__setitem__(rid, o.cached_tokens),
        )

    submit("decoder", other, 40)
    engine.step()  # its prompt alone; from now on it decodes
    submit("hit", shared + tail, 4)  # 116 tokens, 96 of them cached: 20 to compute
    engine.step()
    assert seen[-1] == (1, 20), "the cached 96 tokens were charged, or the chunk was cut"
    while engine.scheduler.has_work():
        engine.step()
    assert cached["hit"] == 96
