"""The reference backend: each row's whole context gathered with index_select into a padded
tensor, one masked SDPA call per group. It copies every context per layer and builds a
[B, 1, Lq, Lk] mask, so it is what the in-place backends are tested against, and the path a
device without one of its own takes; it runs wherever torch does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.model.attn.backend import PagedRows


@dataclass
class PaddedGroup:
    q_index: torch.Tensor  # [B, Lq] int64 into the flat token dim (padding -> 0)
    q_valid: torch.Tensor  # [B, Lq] bool
    kv_slots: torch.Tensor  # [B, Lk] int64 into the cache's flat slot dim (padding -> null)
    mask: torch.Tensor | None  # [B, 1, Lq, Lk] additive: 0 = may attend, -inf = not; None: causal
    flat_valid_index: torch.Tensor  # [N] q_index[q_valid], precomputed once per step
    valid_rows: torch.Tensor | None = None  # [N] rows of the [B*Lq] queries that are real;
    #                                         None when all are (decode: no padding)

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        b, lq = self.q_index.shape
        lk = self.kv_slots.shape[1]
        # index_select on flat indices: a plain row copy, much cheaper on CPU than advanced
        # indexing (aten::index), and the same values.
        qg = q.index_select(0, self.q_index.view(-1)).view(b, lq, *q.shape[1:]).transpose(1, 2)
        flat_slots = self.kv_slots.view(-1)
        kg = k_cache.index_select(0, flat_slots).view(b, lk, *k_cache.shape[1:]).transpose(1, 2)
        vg = v_cache.index_select(0, flat_slots).view(b, lk, *v_cache.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=self.mask, is_causal=self.mask is None, scale=scale,
            enable_gqa=True,
        )
        o = o.transpose(1, 2).reshape(b * lq, *q.shape[1:])
        if self.valid_rows is not None:
            o = o.index_select(0, self.valid_rows)
        if out is None:
            out = torch.empty_like(q)
        return out.index_copy_(0, self.flat_valid_index, o)


@dataclass(frozen=True)
class ReferenceBackend:
    device: torch.device
    null_page: int  # the cache's zeroed page no request owns
    dtype: torch.dtype  # the queries' dtype (an additive mask must match it)
    name: str = "reference"

    def plan(self, rows: PagedRows) -> PaddedGroup:
        return build_group(
            rows.q_starts.tolist(),
            rows.q_lens.tolist(),
            rows.ctx_lens.tolist(),
            rows.page_table,
            rows.page_size,
            rows.window or None,
            self.device,
            self.null_page,
            self.dtype,
        )


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
) -> PaddedGroup:
    """One padded group. Row i has q_lens[i] queries at flat offset q_starts[i], which are the
    last q_lens[i] of its ctx_lens[i] context tokens; page_table[i] (CPU, padded with null_page)
    holds that context's pages in order."""
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
    # chunk behind a cached prefix (128 x 1152: benchmarks/RESULTS.md "Shared prefix"), with the
    # same output bits.
    additive = None
    if not fresh:
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return PaddedGroup(
        q_index=q_index.to(device),
        q_valid=q_valid.to(device),
        kv_slots=kv_slots.to(device),
        mask=None if additive is None else additive.unsqueeze(1).to(device),
        flat_valid_index=q_index[q_valid].to(device),
        valid_rows=None if bool(q_valid.all()) else q_valid.view(-1).nonzero().view(-1).to(device),
    )
