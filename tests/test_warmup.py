"""The boot warm-up (kvfence/engine/warmup.py): after Engine.start the step-cost model has a fit,
the pool holds nothing (every page free, nothing cached) and the warm-up's pages went back
through the pool's free path; a tenant request made of the warm-up's own tokens shares nothing
with it (no cache hit) and gets the answer an engine without a warm-up gives. The pool check is
a guard with its twin; no test reads a clock."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvfence.config import EngineConfig
from kvfence.engine import warmup
from kvfence.engine.engine import Engine
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams
from kvfence.engine.runner import ModelRunner
from kvfence.engine.step_budget import MIN_SAMPLES, StepCost
from kvfence.engine.warmup import WARMUP_TENANT, WarmupError, plan, warmup_tokens
from kvfence.faults import Faults
from kvfence.kv.pool import KVPool
from kvfence.model.config import ModelConfig
from kvfence.server.auth import ApiKeyFileError, parse_api_keys

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
COST = StepCost(a=20.0, b=0.5, c=2.0)  # what the fake clock charges a step, in ms


def engine_for(model: str, faults: Faults | None = None, **kw: object) -> Engine:
    cfg = EngineConfig(model=model, kv_pool_tokens=2048, context_length=256, **kw)  # type: ignore[arg-type]
    return Engine(cfg, faults)


def generate(engine: Engine, tokens: list[int]) -> tuple[list[int], RequestOutput]:
    outs: list[RequestOutput] = []
    done = threading.Event()

    def sink(o: RequestOutput) -> None:
        outs.append(o)
        if o.finished:
            done.set()

    req = GenerateRequest("r1", "default", tuple(tokens), GREEDY)
    engine.submit(req, sink)
    assert done.wait(120), "the request never finished"
    ids = [t for o in outs for t in o.new_token_ids]
    return ids, outs[-1]


def longest_warmup_prompt(engine: Engine) -> list[int]:
    """The warm-up's longest prompt (a mixed step's): the one whose full pages a cache would
    have sealed."""
    steps = plan(engine.pool, 512, 64, engine.context_length)
    assert steps is not None
    n, p = max(enumerate(p for p, _ in steps.steps), key=lambda x: x[1])
    return warmup_tokens(engine.model_config.vocab_size, p, steps.rows + n)


def charge_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A fake clock the warm-up times its steps by: each runner call takes COST of its chunks
    (so the fit does not depend on this machine). Returns the (prefill, decode rows) it ran."""
    now = [0.0]
    seen: list[tuple[int, int]] = []
    real = engine.runner.run

    def run(chunks):  # type: ignore[no-untyped-def]
        d = sum(c.seq.in_decode for c in chunks)
        p = sum(c.length for c in chunks if not c.seq.in_decode)
        seen.append((p, d))
        now[0] += COST.predict(p, d) / 1000
        return real(chunks)

    engine.runner.run = run  # type: ignore[method-assign]
    monkeypatch.setattr(warmup, "clock", lambda: now[0])
    return seen


def test_after_boot_the_fit_exists_the_pool_is_whole_and_a_prompt_of_its_tokens_shares_nothing(
    checkpoint_dir, monkeypatch
) -> None:
    monkeypatch.setattr(warmup, "FULL_PLAN_PARAMS", 1)  # the whole plan, on a tiny model too
    model = str(checkpoint_dir("llama"))
    cold = engine_for(model, boot_warmup=False)
    warm = engine_for(model, kv_poison_on_free=True)
    try:
        cold.start()
        assert not cold.scheduler.step_budget.model.seeds  # the flag turns it off
        seen = charge_steps(warm, monkeypatch)
        warm.start()
        model = warm.scheduler.step_budget.model
        # Every step but the cold ones was measured, at 1, 8 and 32 decode rows.
        assert model.seeds == [(p, d, pytest.approx(COST.predict(p, d))) for p, d in seen[2:]]
        assert len(model.seeds) >= MIN_SAMPLES and {d for _, d, _ in model.seeds} == {1, 8, 32}
        fit = model.cost()
        assert fit is not None
        assert (fit.a, fit.b, fit.c) == pytest.approx((COST.a, COST.b, COST.c), rel=1e-6)
        assert warm.scheduler.step_budget.beside() == (fit, 0)  # a PD decode's first pricing
        stats = warm.stats()
        assert stats.pages_free == stats.pages_total and stats.running == stats.waiting == 0
        assert warm.pool.num_cached == 0 and stats.prefix_cache is not None
        assert stats.prefix_cache.pages == stats.prefix_cache.queries == 0  # never looked up
        assert stats.prefix_cache.holders == 0
        # Its pages went back through the pool's free path: poisoned like any freed page.
        ps = warm.pool.page_size
        assert torch.isnan(warm.pool.k[:, ps : 2 * ps]).all()
        tokens = longest_warmup_prompt(warm)
        assert len(tokens) // ps >= 2  # full pages a cache could have held
        want, _ = generate(cold, tokens)
        got, last = generate(warm, tokens)
        assert got == want and last.cached_tokens == 0
        assert warm.stats().prefix_cache.hits == 0  # type: ignore[union-attr]
    finally:
        cold.shutdown()
        warm.shutdown()


def test_no_credential_can_name_the_warmup_tenant() -> None:
    with pytest.raises(ApiKeyFileError):
        parse_api_keys(f"sk-test {WARMUP_TENANT}\n")


def test_the_plan_fits_the_pool_and_the_context() -> None:
    def pool(pages: int) -> KVPool:
        return KVPool(num_layers=1, num_pages=pages, page_size=16, num_kv_heads=1, head_dim=4,
                      dtype=torch.float32, device="cpu")

    roomy = plan(pool(512), 512, 64, 4096)
    assert roomy is not None and roomy.rows == 32
    assert sorted({d for _, d in roomy.steps}) == [1, 8, 32]
    assert len(roomy.steps) + 1 >= MIN_SAMPLES  # the rows' prompts are measured too
    small = plan(pool(24), 512, 64, 4096)
    assert small is not None and small.pages(pool(24)) <= 24 and small.rows < 32
    capped = plan(pool(512), 512, 4, 4096)
    assert capped is not None and capped.rows == 4
    assert plan(pool(2), 512, 64, 4096) is None  # nothing fits: the warm-up is skipped
    # A small model computes fewer prompt tokens; a tiny one the two cold steps alone.
    assert plan(pool(512), 512, 64, 4096, scale=0.25) == replace(roomy, row_prompt=4,
        steps=tuple((min(p, 32), d) for p, d in roomy.steps))  # fmt: skip
    assert plan(pool(512), 512, 64, 4096, scale=0.01) is None  # a tiny model: no warm-up


def test_the_scale_follows_the_model_shapes() -> None:
    """From the shapes, not the model's tensors (a packed model's no longer list its weights)."""
    assert warmup.model_scale(SimpleNamespace(num_active_params=135_000_000)) == 1.0  # type: ignore[arg-type]
    assert warmup.model_scale(SimpleNamespace(num_active_params=25_000_000)) == 0.25  # type: ignore[arg-type]
    bundled = ModelConfig.from_dir(REPO / "models" / "kvfence-tiny")
    assert warmup.model_scale(bundled) < warmup.FIT_SCALE  # the demo model: cold steps alone


def test_a_tiny_model_runs_no_warmup_step(checkpoint_dir) -> None:
    engine = engine_for(str(checkpoint_dir("llama")))
    seen: list[int] = []
    real = engine.runner.run
    engine.runner.run = lambda chunks: seen.append(len(chunks)) or real(chunks)  # type: ignore[method-assign]
    try:
        engine.start()
        assert seen == [] and engine.stats().pages_free == engine.stats().pages_total
    finally:
        engine.shutdown()


def test_both_pd_roles_warm_up_and_then_serve_exactly(checkpoint_dir, monkeypatch) -> None:
    """Prefill and decode each run the whole plan at start (each has a step budget; decode
    prices its first prompts by the fit), hand back whole pools, and answer as a unified
    engine does."""
    from pd_harness import PDPair, finished_ok

    from kvfence.engine.llm import LLM

    monkeypatch.setattr(warmup, "FULL_PLAN_PARAMS", 1)
    now = [0.0]
    real = ModelRunner.run

    def run(self, chunks):  # type: ignore[no-untyped-def]
        # The fake clock of charge_steps, for both roles' runners (built inside PDPair).
        d = sum(c.seq.in_decode for c in chunks)
        now[0] += COST.predict(sum(c.length for c in chunks if not c.seq.in_decode), d) / 1000
        return real(self, chunks)

    monkeypatch.setattr(ModelRunner, "run", run)
    monkeypatch.setattr(warmup, "clock", lambda: now[0])
    model = str(checkpoint_dir("llama"))
    pair = PDPair(model, kv_pool_tokens=2048, context_length=256)
    try:
        for svc in (pair.prefill, pair.decode):
            budget = svc.engine.scheduler.step_budget
            assert len(budget.model.seeds) >= MIN_SAMPLES
            fit = budget.model.cost()
            assert fit is not None and budget.beside() == (fit, 0)
            assert (fit.a, fit.b, fit.c) == pytest.approx((COST.a, COST.b, COST.c), rel=1e-6)
            assert svc.engine.stats().pages_free == svc.engine.stats().pages_total
            assert svc.engine.pool.num_cached == 0
        prompt = warmup_tokens(pair.decode.engine.model_config.vocab_size, 128, 33)
        (got,) = pair.generate([prompt], GREEDY)
        (want,) = LLM(model, kv_pool_tokens=2048, context_length=256).generate([prompt], GREEDY)
        assert finished_ok(got) and got.token_ids == want.token_ids
        assert got.final is not None and got.final.cached_tokens == 0
        assert pair.wait_idle()
    finally:
        pair.close()


def test_a_warmup_that_keeps_a_page_stops_the_engine_from_starting(
    checkpoint_dir, monkeypatch
) -> None:
    """The guard: a page the warm-up kept would shrink the capacity the boot check vouched for
    (I7), so start() refuses."""
    monkeypatch.setattr(warmup, "FULL_PLAN_PARAMS", 1)
    faults = Faults()
    faults.arm("warmup_keeps_pages")
    engine = engine_for(str(checkpoint_dir("llama")), faults)
    try:
        with pytest.raises(WarmupError, match="pages held"):
            engine.start()
    finally:
        engine.shutdown()


def test_twin_without_the_check_the_engine_starts_with_pages_held(
    checkpoint_dir, monkeypatch
) -> None:
    """Twin: with the check off the same warm-up starts an engine whose pool is short, which
    the pool check after boot (the first test's) catches."""
    monkeypatch.setattr(warmup, "FULL_PLAN_PARAMS", 1)
    faults = Faults()
    faults.arm("warmup_keeps_pages")
    faults.arm("skip_warmup_check")
    engine = engine_for(str(checkpoint_dir("llama")), faults)
    try:
        engine.start()
        stats = engine.stats()
        assert stats.pages_free < stats.pages_total
    finally:
        engine.shutdown()
