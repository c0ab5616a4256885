"""Paged attention over one layer's K/V cache: write new K/V by slot, then attend per group of
rows.

A step's tokens are flat [T]. Sequences are split into groups of similar query length (decode:
1, prefill: a chunk). A torch group gathers its rows' pages into a padded tensor and runs one
masked SDPA call; a native decode group hands the page table to the CPU kernel
(kvfence/model/kernels), which reads each row's K/V in place and never copies the context. Either
way the hot path is a handful of tensor ops per layer, never a Python loop over tokens or pages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    q_index: torch.Tensor  # [B, Lq] int64 into the flat token dim (padding -> 0)
    q_valid: torch.Tensor  # [B, Lq] bool
    kv_slots: torch.Tensor  # [B, Lk] int64 into the cache's flat slot dim (padding -> null)
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] additive: 0 = may attend, -inf = not; None: causal
    flat_valid_index: torch.Tensor  # [N] q_index[q_valid], precomputed once per step
    valid_rows: torch.Tensor | None = None  # [N] rows of the [B*Lq] queries that are real;
    #                                         None when all are (decode: no padding)


@dataclass
class NativeDecodeGroup:
    """Decode rows (one query each) for the native kernel: it reads slots [max(0, ctx - window),
    ctx) of each row's pages and nothing else."""

    q_index: torch.Tensor | None  # [B] int64 into the flat token dim; None: every token, in order
    page_table: torch.Tensor  # [B, P] int64
    ctx_lens: torch.Tensor  # [B] int64
    kernel: Callable[..., torch.Tensor]
    page_size: int
    window: int  # 0: no sliding window


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: list[AttentionGroup | NativeDecodeGroup]


def build_group(
    q_starts: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    page_table: torch.Tensor,
    page_size: int,
    sliding_window: int | None,
    device: torch.device,
    null_page: int,
    dtype: torch.dtype = torch.float32,
) -> AttentionGroup:
    """One padded group. Row i has q_lens[i] queries at flat offset q_starts[i], which are the
    last q_lens[i] of its ctx_lens[i] context tokens; page_table[i] (CPU, padded with null_page)
    holds that context's pages in order. null_page: the cache's zeroed page no request owns.
    dtype: the queries' dtype (an additive mask must match it)."""
    b = len(q_lens)
    lq, lk = max(q_lens), max(ctx_lens)
    q_start = torch.tensor(q_starts, dtype=torch.int64)
    q_len = torch.tensor(q_lens, dtype=torch.int64)
    ctx = torch.tensor(ctx_lens, dtype=torch.int64)
    ar_q = torch.arange(lq)
    q_valid = ar_q[None, :] < q_len[:, None]
    q_index = torch.where(q_valid, q_start[:, None] + ar_q[None, :], 0)
    offsets = torch.arange(page_size, dtype=torch.int64)
    kv_slots = (page_table[:, :, None] * page_size + offsets).reshape(b, -1)[:, :lk]
    k_pos = torch.arange(lk)
    # Slots past a row's context (its last page's stale tail, row padding) read the null page's
    # first slot: never another request's data, and finite, so masking them out is exact.
    kv_slots = torch.where(k_pos[None, :] < ctx[:, None], kv_slots, null_page * page_size)
    q_pos = (ctx - q_len)[:, None] + ar_q[None, :]  # absolute position of each query
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < ctx[:, None, None])
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # Padding queries attend to slot 0 only so SDPA never sees an all-masked row (NaN); dropped.
    mask[:, :, 0] |= ~q_valid
    # Every row a fresh prompt (queries == context): the mask is exactly SDPA's is_causal, which
    # runs about twice as fast. Padded keys sit after every real query of their row, so causality
    # alone keeps them out; padded queries see only finite values (their row's keys, then the
    # null slot) and are dropped.
    fresh = sliding_window is None and bool((q_len == ctx).all())
    # The mask goes to SDPA additive (0 / -inf), not bool: SDPA turns a bool mask into exactly
    # this tensor anyway, but on CPU its bool path is 1.4-2.4x slower at the shapes of a prompt
    # chunk behind a cached prefix (128 x 1152: benchmarks/RESULTS.md), with the same output bits.
    additive = None
    if not fresh:
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return AttentionGroup(
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        kv_slots=kv_slots.to(device),
        mask=None if additive is None else additive.unsqueeze(1).to(device),
        flat_valid_index=q_index[q_valid].to(device),
        valid_rows=None if bool(q_valid.all()) else q_valid.view(-1).nonzero().view(-1).to(device),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [slots, KVH, D] of one layer. Returns [T, H, D].
    k and v None: the caller already wrote them at meta.slot_mapping (the native rope_store)."""
    if k is not None and v is not None:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    else:
        assert k is None and v is None, "k and v are written together"
    out = torch.empty_like(q)
    for g in meta.groups:
        if isinstance(g, NativeDecodeGroup):
            rows = q.contiguous() if g.q_index is None else q.index_select(0, g.q_index)
            o = g.kernel(
                rows, k_cache, v_cache, g.page_table, g.ctx_lens, g.page_size, scale, g.window
            )
            if g.q_index is None:  # a decode-only step: the kernel's output is the answer
                return o
            out.index_copy_(0, g.q_index, o)
            continue
        b, lq = g.q_index.shape
        lk = g.kv_slots.shape[1]
        # index_select on flat indices: a plain row copy, much cheaper on CPU than advanced
        # indexing (aten::index), and the same values.
        qg = q.index_select(0, g.q_index.view(-1)).view(b, lq, *q.shape[1:]).transpose(1, 2)
        flat_slots = g.kv_slots.view(-1)
        kg = k_cache.index_select(0, flat_slots).view(b, lk, *k_cache.shape[1:]).transpose(1, 2)
        vg = v_cache.index_select(0, flat_slots).view(b, lk, *v_cache.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=g.mask, is_causal=g.mask is None, scale=scale, enable_gqa=True
        )
        o = o.transpose(1, 2).reshape(b * lq, *q.shape[1:])
        if g.valid_rows is not None:
            o = o.index_select(0, g.valid_rows)
        out.index_copy_(0, g.flat_valid_index, o)
    return out
