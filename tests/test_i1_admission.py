"""I1: a request that fails admission never holds a page, a queue slot or a batch entry, and its
caller gets the original reason. The twin arms `skip_admission` and shows the check catches it."""

from __future__ import annotations

import pytest

from kvfence.engine.admission import AdmissionLimits, Admitted, Rejected, admit
from kvfence.engine.engine import Engine
from kvfence.engine.llm import LLM
from kvfence.engine.request import GenerateRequest, SamplingParams

CTX = 64
LIMITS = AdmissionLimits(context_length=CTX, pool_tokens=48, vocab_size=256)


def req(n: int, max_tokens: int | None = None, tok: int = 5) -> GenerateRequest:
    return GenerateRequest("r", "t", (tok,) * n, SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(
    ("n", "max_tokens", "code"),
    [
        (0, None, "empty_prompt"),
        (CTX, None, "context_length_exceeded"),
        (CTX + 1, None, "context_length_exceeded"),
        (40, 30, "context_length_exceeded"),
        (49, 2, "exceeds_kv_pool"),
        (40, 10, "exceeds_kv_pool"),
    ],
)
def test_i1_admit_rejects_with_reason(n: int, max_tokens: int | None, code: str) -> None:
    verdict = admit(req(n, max_tokens), LIMITS)
    assert isinstance(verdict, Rejected) and verdict.code == code and verdict.message


def test_i1_admit_rejects_out_of_vocab_ids() -> None:
    verdict = admit(req(3, tok=256), LIMITS)
    assert isinstance(verdict, Rejected) and verdict.code == "invalid_token_id"


def test_i1_admit_resolves_default_max_tokens() -> None:
    verdict = admit(
        GenerateRequest("r", "t", (1,) * 10, SamplingParams()), AdmissionLimits(64, 64, 256)
    )
    assert isinstance(verdict, Admitted) and verdict.max_tokens == 54


def assert_nothing_held(engine: Engine) -> None:
    """The I1 check: no page used, nothing queued, running or pending in the inbox."""
    engine.step()  # drains the inbox, so anything smuggled in would now be queued or running
    s = engine.stats()
    assert s.pages_used == 0, "a rejected request holds pages"
    assert s.waiting == 0 and s.running == 0, "a rejected request sits in the scheduler"


def over_length(engine: Engine) -> list[GenerateRequest]:
    ctx, pool = engine.context_length, engine.pool.capacity_tokens
    return [
        GenerateRequest("ctx+1", "t", (5,) * (ctx + 1), SamplingParams(max_tokens=1)),
        GenerateRequest("pool+1", "t", (5,) * (pool + 1), SamplingParams(max_tokens=1)),
        GenerateRequest("sum", "t", (5,) * (ctx - 4), SamplingParams(max_tokens=5)),
    ]


@pytest.fixture
def engine(checkpoint_dir) -> Engine:
    return LLM(str(checkpoint_dir("llama")), kv_pool_tokens=128, context_length=128).engine


def test_i1_over_length_rejected_before_any_allocation(engine: Engine) -> None:
    for r in over_length(engine):
        verdict = engine.submit(r, lambda o: pytest.fail("a rejected request produced output"))
        assert isinstance(verdict, Rejected), r.request_id
        assert verdict.code in ("context_length_exceeded", "exceeds_kv_pool")
    assert_nothing_held(engine)


def test_i1_twin_skip_admission_is_caught(engine: Engine) -> None:
    with engine.faults.injected("skip_admission"):
        for r in over_length(engine):
            engine.submit(r, lambda o: None)
        with pytest.raises(AssertionError):
            assert_nothing_held(engine)
