"""The padded attention group's mask: additive (0 / -inf, in the queries' dtype), bottom-right
causal for a chunk behind a cached prefix, and SDPA's output with it is bit-identical to the bool
mask it replaced."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfence.model.attn.reference import build_group

PS = 4
NULL = 0


def _group(q_lens: list[int], ctx: list[int], window: int | None = None):
    pages = max(-(-c // PS) for c in ctx)
    table = torch.arange(1, 1 + len(ctx) * pages).view(len(ctx), pages)
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    return build_group(starts, q_lens, ctx, table, PS, window, torch.device("cpu"), NULL)


def test_chunk_behind_prefix_is_additive_bottom_right_causal() -> None:
    # Row 0: 3 new tokens after 5 cached ones; row 1: 1 new token after 9 (padded to 3 queries).
    g = _group([3, 1], [8, 10])
    assert g.mask is not None and g.mask.dtype == torch.float32
    m = g.mask[:, 0]
    assert set(m.unique().tolist()) == {0.0, float("-inf")}
    allowed = m == 0
    for q in range(3):  # row 0's query q sits at position 5 + q and sees keys 0..5+q
        assert allowed[0, q, : 6 + q].all() and not allowed[0, q, 6 + q :].any()
    assert allowed[1, 0, :10].all()  # row 1's one real query sees its whole context
    assert allowed[1, 1:].any(dim=-1).all()  # padding queries: never an all -inf row (NaN)


def test_fresh_prompts_use_is_causal_and_window_keeps_a_mask() -> None:
    assert _group([4, 4], [4, 4]).mask is None
    g = _group([4], [4], window=2)
    assert g.mask is not None
    assert ((g.mask[0, 0] == 0) == torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)).all()


def test_sdpa_output_same_bits_as_bool_mask() -> None:
    torch.manual_seed(0)
    g = _group([16, 5], [40, 29])
    assert g.mask is not None
    b, lq, lk = 2, 16, 40
    q, k, v = torch.randn(b, 6, lq, 16), torch.randn(b, 2, lk, 16), torch.randn(b, 2, lk, 16)
    additive = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, enable_gqa=True)
    boolean = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask == 0, enable_gqa=True)
    assert torch.equal(additive, boolean)
