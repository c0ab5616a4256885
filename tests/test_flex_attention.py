"""The flex backend (kvfence/model/attn/flex.py), CUDA's default, run on CPU through the same
code: the same answers as the reference gather for decode rows and chunks behind a cached
prefix, no read of a slot its rows may not see, and greedy generation token-exact with the
reference for a dense, a Qwen3 and a MoE model, with prefix-cache hits and chunked prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from test_paged_prefill import NULL, PAGE, allowed_slots, random_rows, rows_of

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.model.attn import PagedRows, select_backend
from kvfence.model.attn.reference import ReferenceBackend

CPU = torch.device("cpu")


def _flex():
    return select_backend("flex", CPU, torch.float32, torch.float32, NULL)


@pytest.mark.parametrize("window", [0, 7])
def test_flex_mixed_step_equals_reference(window) -> None:
    """Decode rows and chunks behind a prefix, as two groups writing into one output."""
    ctx_lens, q_lens = [50, 9, 200, 33, 17], [1, 9, 70, 1, 3]
    kc, vc, _, table, g = random_rows(ctx_lens, q_lens, 2, 16, torch.float32)
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    full = rows_of(ctx_lens, q_lens, table, window)
    outs = {}
    for backend in (_flex(), ReferenceBackend(CPU, NULL, torch.float32)):
        out = None
        for sel in ([0, 3], [1, 2, 4]):
            s = torch.tensor(sel)
            rows = PagedRows(full.q_starts[s], full.q_lens[s], full.ctx_lens[s], table[s], PAGE,
                             window, covers_step=False)
            out = backend.plan(rows).run(q, kc, vc, 0.25, out)
        outs[backend.name] = out
    torch.testing.assert_close(outs["flex"], outs["reference"], atol=1e-5, rtol=1e-5)


def test_flex_decode_only_step_with_known_chunk_length() -> None:
    """A decode step planned with max_q_len=1 (as a captured graph plans it) answers in place."""
    ctx_lens = [5, 64, 17]
    kc, vc, _, table, g = random_rows(ctx_lens, [1, 1, 1], 2, 16, torch.float32)
    q = torch.randn(3, 4, 16, generator=g)
    rows = rows_of(ctx_lens, [1, 1, 1], table, 0)
    known = PagedRows(rows.q_starts, rows.q_lens, rows.ctx_lens, rows.page_table, PAGE, 0,
                      covers_step=True, max_q_len=1)
    got = _flex().plan(known).run(q, kc, vc, 0.25, None)
    want = ReferenceBackend(CPU, NULL, torch.float32).plan(rows).run(q, kc, vc, 0.25, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flex_never_attends_a_slot_no_query_may_see() -> None:
    """A huge value everywhere outside the rows' contexts (stale tails, other pages, the null
    page) and before the window: the answers are unchanged; one more slot of context (the twin)
    reaches the poison. Finite, not NaN: a masked slot that flex reads still enters P.V times 0
    (unfused on CPU every slot, fused on CUDA its row's last page), as in the reference."""
    ctx_lens, q_lens, window = [37, 100, 20], [5, 30, 1], 40
    kc, vc, _, table, g = random_rows(ctx_lens, q_lens, 2, 16, torch.float32)
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    allowed = allowed_slots(ctx_lens, q_lens, table, window, kc.shape[0])
    poisoned = [c.clone() for c in (kc, vc)]
    for c in poisoned:
        c[~allowed] = 1e4
    rows = rows_of(ctx_lens, q_lens, table, window)
    want = _flex().plan(rows).run(q, kc, vc, 0.25, None)
    assert torch.equal(_flex().plan(rows).run(q, *poisoned, 0.25, None), want)
    assert want.abs().max() < 100
    stale = rows_of([n + 1 for n in ctx_lens], [m + 1 for m in q_lens], table, window)
    q2 = torch.randn(sum(m + 1 for m in q_lens), 4, 16, generator=g)
    assert _flex().plan(stale).run(q2, *poisoned, 0.25, None).abs().max() > 1000


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_flex_engine_token_exact_with_reference(checkpoint_dir, arch) -> None:
    """Greedy answers through the engine: a staggered batch with chunked prefill (chunks of 24
    behind earlier chunks), then prompts sharing a 40-token prefix with the first batch's, so
    their prefill starts behind prefix-cache pages."""
    model = str(checkpoint_dir(arch))
    first = random_prompts([3, 17, 50, 70], vocab=256, seed=5)
    again = [first[2][:40] + p for p in random_prompts([5, 11], vocab=256, seed=6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = {}
    for backend in ("flex", "torch"):
        llm = LLM(model, kv_pool_tokens=512, context_length=128, page_size=PAGE,
                  chunked_prefill_size=24, attention_backend=backend)
        want = {"flex": "flex", "torch": "reference"}[backend]
        assert llm.engine.runner.attention.name == want
        answers = [c.token_ids for c in llm.generate(first, params)]
        answers += [c.token_ids for c in llm.generate(again, params)]
        assert llm.engine.pool.prefix is not None and llm.engine.pool.num_cached > 0
        out[backend] = answers
    assert out["flex"] == out["torch"]


def test_flex_flag_is_validated_and_any_device_may_ask_for_it() -> None:
    assert EngineConfig(model="m", device="cuda", attention_backend="flex").attention_backend
    with pytest.raises(ConfigError, match="--attention-backend"):
        EngineConfig(model="m", attention_backend="flash")
    with pytest.raises(RuntimeError, match="dtype"):
        select_backend("flex", CPU, torch.float32, torch.bfloat16, NULL)
    cuda = select_backend("auto", torch.device("cuda"), torch.bfloat16, torch.bfloat16, NULL)
    assert cuda.name == "flex"
