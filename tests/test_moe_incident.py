"""The incident's three outcomes on the incident's own model family: a GLM-4 MoE checkpoint (tiny,
random) behind an in-process 1P1D pair whose prefill pool is smaller than the context.

A random model cannot recall a canary, so the guards-off twin measures the breach itself instead
of its symptom: B's decode step attends over pages that still hold, byte for byte, the K rows
tenant A's requests left there (what the bundled recall model would have copied out as A's
canary). With guards on, B gets 400 and nothing is transferred; with the placeholder bug and the
other guards on, B fails closed and never runs a step.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import random_prompts
from pd_harness import PDPair, Result, finished_ok

from kvfence.engine.admission import Rejected
from kvfence.engine.request import FinishReason, SamplingParams

CTX, PREFILL_POOL, DECODE_POOL, PAGE = 256, 128, 256, 16
B_LEN = 200  # fits the context and decode's pool, not prefill's
GUARDS_OFF = ("skip_count_check", "skip_checksum", "skip_tag_check")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Watch:
    """Spies on decode's steps: the pages each request's rows ran over, and for B's first
    step a copy of the K rows of its pages at the moment it attends over them."""

    def __init__(self, pair: PDPair) -> None:
        self.pool = pair.decode.engine.pool
        self.pages: dict[str, set[int]] = {}
        self.b_rid = ""
        self.b_step: tuple[list[int], torch.Tensor] | None = None
        runner = pair.decode.engine.runner
        real = runner.run

        def run(chunks):  # type: ignore[no-untyped-def]
            for c in chunks:
                rid = c.seq.request_id
                self.pages.setdefault(rid, set()).update(c.seq.pages)
                if rid == self.b_rid and self.b_step is None:
                    self.b_step = (list(c.seq.pages), self.pool.k.clone())
            return real(chunks)

        runner.run = run

    def rows(self, page: int) -> slice:
        return slice(page * PAGE, (page + 1) * PAGE)


@pytest.fixture
def pair(checkpoint_dir) -> Iterator[PDPair]:
    pd = PDPair(
        str(checkpoint_dir("glm4_moe")),
        kv_pool_tokens=PREFILL_POOL,
        decode_kwargs={"kv_pool_tokens": DECODE_POOL},
        context_length=CTX,
        page_size=PAGE,
        chunked_prefill_size=64,
        unsafe_skip_preflight=True,
    )
    yield pd
    pd.close()


def bait_and_ask(pair: PDPair, watch: Watch) -> tuple[Result | Rejected, list[str], torch.Tensor]:
    """Tenant A's prompts cycle through decode's pages; then B asks. Returns B's verdict, A's
    request ids and decode's K cache as A left it."""
    a_ids = []
    for i, p in enumerate(random_prompts([120, 120, 120], vocab=256, seed=31)):
        rid, r = pair.submit(p, SamplingParams(max_tokens=4), tenant="tenant-a", rid=f"a{i:031d}")
        assert isinstance(r, Result) and r.done.wait(60) and finished_ok(r)
        a_ids.append(rid)
    assert pair.wait_idle()
    after_a = pair.decode.engine.pool.k.clone()
    watch.b_rid = "b" * 32
    [b_prompt] = random_prompts([B_LEN], vocab=256, seed=32)
    _, r = pair.submit(b_prompt, GREEDY, tenant="tenant-b", rid=watch.b_rid)
    if isinstance(r, Result):
        assert r.done.wait(60), "B's request did not finish"
    return r, a_ids, after_a


def test_glm4_moe_incident_guards_on_b_gets_400_and_nothing_is_transferred(pair) -> None:
    watch = Watch(pair)
    sent = pair.prefill.transfer_stats.get("pages_sent")
    r, a_ids, _ = bait_and_ask(pair, watch)
    sent_for_a = pair.prefill.transfer_stats.get("pages_sent") - sent
    assert isinstance(r, Result) and r.final is not None
    assert r.final.finish_reason is FinishReason.ERROR
    assert (r.final.error_status, r.final.error_code) == (400, "exceeds_kv_pool")
    assert r.token_ids == [] and watch.b_rid not in watch.pages
    assert pair.prefill.transfer_stats.get("rejected") == 1
    assert pair.prefill.transfer_stats.get("pages_sent") - sent == sent_for_a  # none for B
    assert pair.wait_idle()


def test_glm4_moe_incident_placeholder_with_other_guards_on_fails_closed(pair) -> None:
    watch = Watch(pair)
    with pair.faults.injected("placeholder_on_reject"):
        r, _, _ = bait_and_ask(pair, watch)
    assert isinstance(r, Result) and r.final is not None
    assert r.final.finish_reason is FinishReason.ERROR and r.final.error_status == 500
    assert r.final.error_code in ("kv_transfer_incomplete", "kv_integrity_error")
    assert r.token_ids == [] and watch.b_rid not in watch.pages, "B ran a decode step"
    assert pair.wait_idle()


def test_glm4_moe_incident_twin_guards_off_b_attends_over_tenant_a_pages(pair) -> None:
    watch = Watch(pair)
    with pair.faults.injected("placeholder_on_reject", *GUARDS_OFF):
        r, a_ids, after_a = bait_and_ask(pair, watch)
    assert isinstance(r, Result) and finished_ok(r), "the twin's B should be answered (200)"
    assert watch.b_step is not None, "B never ran on decode"
    b_pages, k_at_b = watch.b_step
    a_pages = set().union(*(watch.pages[rid] for rid in a_ids))
    # B's pages past the placeholder's first page and before its own decode writes: nothing of
    # B was ever written there, so whatever B attends over is what the last owner left.
    stale = [p for p in b_pages[1 : B_LEN // PAGE] if p in a_pages]
    assert stale, f"B got none of A's pages ({b_pages} vs {sorted(a_pages)})"
    for p in stale:
        rows = watch.rows(p)
        assert torch.equal(k_at_b[:, rows], after_a[:, rows]), f"page {p} was rewritten"
    assert pair.wait_idle()
