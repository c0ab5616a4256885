"""Paged attention over one layer's K/V cache: write the step's new K/V at their slots, then let
each group of rows attend through its backend (kvfence/model/attn: the native CPU kernels read
pages in place; the reference gathers). The groups are planned once per step by the runner, so a
layer's work is a handful of tensor ops, never a Python loop over tokens or pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfence.model.attn.backend import AttentionGroup


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: list[AttentionGroup]


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
    out: torch.Tensor | None = None
    for g in meta.groups:
        out = g.run(q, k_cache, v_cache, scale, out)
    assert out is not None, "a step has at least one group"
    return out
