"""Per-tenant fair share of the running set (kvfence/engine/fairness.py): one tenant's many long
requests cannot keep another tenant's small one waiting. Twin: unfair_admission (plain FIFO)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import random_prompts

from kvfence.engine.fairness import next_waiting
from kvfence.engine.llm import LLM
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults


@dataclass
class S:
    tenant: str


def test_each_tenants_first_competes_and_the_fewest_held_wins() -> None:
    waiting = [S("a"), S("a"), S("b"), S("c")]
    assert next_waiting(waiting, [S("a"), S("b")], None) == 3  # c holds none
    assert next_waiting(waiting, [S("a"), S("a"), S("b"), S("c")], None) == 2  # b holds 1
    assert next_waiting(waiting, [], None) == 0  # ties: the earlier arrival
    assert next_waiting([], [S("a")], None) is None


def test_a_tenant_at_its_cap_is_skipped_and_none_when_all_are() -> None:
    waiting = [S("a"), S("b")]
    assert next_waiting(waiting, [S("a")], per_tenant_cap=1) == 1
    assert next_waiting(waiting, [S("a"), S("b")], per_tenant_cap=1) is None
    assert next_waiting(waiting, [S("a"), S("b")], per_tenant_cap=2) == 0


def test_twin_unfair_is_the_queue_head_whatever_it_holds() -> None:
    assert next_waiting([S("a"), S("b")], [S("a")] * 5, 1, fair=False) == 0


def _run(model: str, faults: Faults) -> tuple[list[str], dict[str, int]]:
    """Tenant a sends three long requests, then tenant b one short one; two running slots, one
    per tenant. Returns the order requests finished and each one's tokens when b finished."""
    llm = LLM(model, faults, kv_pool_tokens=1024, context_length=128, max_running_requests=2,
              max_running_requests_per_tenant=1)
    prompts = random_prompts([6, 6, 6, 6], vocab=256, seed=5)
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    produced: dict[str, int] = {}
    finished: list[str] = []
    at_b: dict[str, int] = {}

    def sink(o: RequestOutput) -> None:
        produced[o.request_id] = o.completion_tokens
        if o.finished:
            finished.append(o.request_id)
            if o.request_id == "b0":
                at_b.update(produced)

    for i in range(3):
        llm.engine.submit(GenerateRequest(f"a{i}", "a", tuple(prompts[i]), long), sink)
    llm.engine.submit(GenerateRequest("b0", "b", tuple(prompts[3]), short), sink)
    for _ in range(400):
        if len(finished) == 4:
            break
        llm.engine.step()
    assert len(finished) == 4, f"not all finished: {finished}"
    return finished, at_b


def test_tenant_b_runs_while_tenant_a_waits_over_its_share(checkpoint_dir) -> None:
    finished, at_b = _run(str(checkpoint_dir("llama")), Faults())
    assert finished[0] == "b0", finished
    # a1 and a2 were queued before b0 and over a's share: they had not started.
    assert at_b.get("a1", 0) == 0 and at_b.get("a2", 0) == 0, at_b


def test_twin_unfair_admission_keeps_b_behind_a(checkpoint_dir) -> None:
    faults = Faults()
    with faults.injected("unfair_admission"):
        finished, at_b = _run(str(checkpoint_dir("llama")), faults)
    # FIFO: a0 and a1 take both slots; b0 waits behind them.
    assert finished.index("b0") > finished.index("a0"), finished
    assert at_b.get("a1", 0) > 0, at_b


def test_per_tenant_cap_is_validated() -> None:
    from kvfence.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="--max-running-requests-per-tenant"):
        EngineConfig(model="x", max_running_requests_per_tenant=0)
