"""Helpers for the prefix cache's engine tests: submit requests in waves (tenant, salt), collect
each answer with its cached_tokens, and check the pool and the cache are back to baseline."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.engine.engine import Engine
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams


@dataclass
class Ask:
    rid: str
    prompt: list[int]
    tenant: str = "t"
    salt: str | None = None


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    cached: int = 0
    finish: FinishReason | None = None
    error_code: str | None = None


MAX_STEPS = 20_000  # a bound, so a scheduling bug fails the test instead of hanging it


def run_waves(
    engine: Engine, waves: list[list[Ask]], params: SamplingParams, gap: int = 3
) -> dict[str, Answer]:
    """Submit each wave, step `gap` times between waves (later waves join a running batch and
    find the earlier ones' sealed pages), then step until every request finished."""
    answers: dict[str, Answer] = {}

    def sink(o: RequestOutput) -> None:
        a = answers[o.request_id]
        a.tokens.extend(o.new_token_ids)
        a.text += o.new_text
        a.cached = o.cached_tokens
        if o.finish_reason is not None:
            a.finish, a.error_code = o.finish_reason, o.error_code

    for i, wave in enumerate(waves):
        for ask in wave:
            answers[ask.rid] = Answer()
            req = GenerateRequest(
                ask.rid, ask.tenant, tuple(ask.prompt), params, cache_salt=ask.salt
            )
            engine.submit(req, sink)
        for _ in range(gap if i < len(waves) - 1 else 0):
            engine.step()
    steps = 0
    while any(a.finish is None for a in answers.values()):
        engine.step()
        steps += 1
        assert steps < MAX_STEPS, "requests did not finish"
    return answers


def assert_baseline(engine: Engine) -> None:
    """Nothing is held once every request finished: every page is free or cached with no
    reference, and the cache has no holder left."""
    s = engine.stats()
    assert s.running == 0 and s.waiting == 0
    assert s.pages_used == 0 and s.pages_free == s.pages_total
    prefix = engine.pool.prefix
    if prefix is not None:
        assert prefix.num_holders == 0, "a finished request still references cache pages"
        assert prefix.num_evictable == prefix.num_cached
