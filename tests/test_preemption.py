"""Continuous batching under a pool too small for everyone: preemption by recompute keeps every
answer token-exact and returns every page."""

from __future__ import annotations

from conftest import random_prompts

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def test_48_concurrent_requests_with_small_pool_finish_token_exact(checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir("llama"))
    lengths = [(7 * i) % 60 + 1 for i in range(48)]
    prompts = random_prompts(lengths, vocab=256, seed=7)
    roomy = LLM(model_dir, kv_pool_tokens=8192, chunked_prefill_size=256, context_length=128)
    want = [c.token_ids for c in roomy.generate(prompts, GREEDY)]
    # 16 pages of 16 = 256 tokens: room for about 3 of the 48 at once.
    # No step-time target (it reads the clock): the same chunks, so preemptions, on every machine.
    tight = LLM(
        model_dir,
        kv_pool_tokens=256,
        chunked_prefill_size=64,
        context_length=128,
        max_decode_step_ms=0,
    )
    got = tight.generate(prompts, GREEDY)
    assert [c.token_ids for c in got] == want
    stats = tight.engine.stats()
    assert stats.preemptions > 0, "the pool was meant to run out"
    assert stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0


def test_fifo_order_is_kept_when_the_pool_is_full(checkpoint_dir) -> None:
    llm = LLM(str(checkpoint_dir("llama")), kv_pool_tokens=128, context_length=128)
    prompts = random_prompts([100, 10, 10], vocab=256, seed=2)
    finish_order: list[str] = []
    from kvfence.engine.request import GenerateRequest

    def sink(o) -> None:
        if o.finished:
            finish_order.append(o.request_id)

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        llm.engine.submit(GenerateRequest(f"r{i}", "t", tuple(p), params), sink)
    while len(finish_order) < 3:
        llm.engine.step()
    # r0 needs 120 of the 128 tokens; r1/r2 must not overtake it while it waits for pages.
    assert finish_order[0] == "r0"


def test_decode_step_prefill_budget_caps_prefill_while_decoding(checkpoint_dir) -> None:
    """A step that decodes adds at most the budget of prefill tokens; a step with no decode
    still takes a whole chunk. Answers stay the same."""
    from kvfence.engine.request import GenerateRequest

    model_dir = str(checkpoint_dir("llama"))
    prompts = random_prompts([10, 100], vocab=256, seed=21)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=1024).generate(prompts, params)]
    llm = LLM(model_dir, kv_pool_tokens=1024, chunked_prefill_size=64, decode_step_prefill_budget=8)
    engine = llm.engine
    seen: list[tuple[int, int]] = []  # (decode rows, prefill tokens) per step
    real = engine.runner.run

    def spy(chunks):  # type: ignore[no-untyped-def]
        decodes = sum(c.seq.in_decode for c in chunks)
        seen.append((decodes, sum(c.length for c in chunks if not c.seq.in_decode)))
        return real(chunks)

    engine.runner.run = spy
    outs: dict[str, list[int]] = {"a": [], "b": []}

    def submit(rid: str, prompt: list[int]) -> None:
        sink = outs[rid].extend
        request = GenerateRequest(rid, "t", tuple(prompt), params)
        engine.submit(request, lambda o: sink(o.new_token_ids))

    submit("a", prompts[0])
    engine.step()  # a's prompt alone: a whole chunk
    submit("b", prompts[1])
    while engine.scheduler.has_work():
        engine.step()
    assert [outs["a"], outs["b"]] == want
    assert seen[0] == (0, 10)
    with_decode = [p for d, p in seen if d]
    assert with_decode and max(with_decode) <= 8 and 8 in with_decode
    alone = [p for d, p in seen if not d and p]
    assert alone and max(alone) > 8  # after a finishes, b's rest runs in 64-token chunks
