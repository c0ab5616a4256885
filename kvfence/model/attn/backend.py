"""The attention seam: what the runner hands a backend for each step (PagedRows) and the two calls
every backend answers (plan once per step on the host, run once per layer).

A backend reads K/V in place from the pool's per-layer caches through the page table and the
context lengths: decode rows (one query each) and prefill chunks behind any cached prefix (causal
inside the chunk) alike. The only backend that copies a context is the reference
(reference.py), kept as what the others are tested against.

Adding a device (the CUDA backend, say) means one class with this shape and one line in
`select_backend` (kvfence/model/attn/__init__.py):

- `plan(rows)` runs once per step, before the first layer, on the host. It may move the rows'
  tensors to the device, build indptr arrays or a block mask, pick a kernel variant, or bucket
  the batch for a captured graph; whatever it returns is reused by every layer of the step, so
  per-layer work stays on the device. It must not read the caches.
- `group.run(q, k_cache, v_cache, scale, out)` runs once per layer after the step's K/V were
  written at their slots. q [T, H, D] holds every token of the step (the rows' queries at
  q_starts); k_cache, v_cache [slots, KVH, D] are one layer's caches, slot = page * page_size +
  offset, in the pool's dtype. It writes the rows' answers [q_len, H, D] at the same flat rows
  of out (None: the first group of the step, which allocates out, or, when its rows cover the
  step, may return its own tensor) and returns out. A row may read only slots
  [max(0, position - window + 1), position] of its own pages for each query at `position`;
  never a page's tail past ctx_len (stale data of an earlier grant: invariant I2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class PagedRows:
    """Rows of one step: row i's q_lens[i] queries are the flat tokens [q_starts[i],
    q_starts[i] + q_lens[i]) of the step and the last q_lens[i] of its ctx_lens[i] context
    tokens, whose K/V sit in page_table[i]'s pages in order (padded with the null page, which no
    request owns). All int64 tensors on the host. window: sliding window, 0 for none."""

    q_starts: torch.Tensor  # [B]
    q_lens: torch.Tensor  # [B]
    ctx_lens: torch.Tensor  # [B]
    page_table: torch.Tensor  # [B, P], P = pages of the longest context
    page_size: int
    window: int
    covers_step: bool  # the rows are every token of the step, in order
    # The longest chunk when the caller knows it (a captured decode step: 1), so a backend that
    # plans on the device need not read q_lens back; 0: ask q_lens.
    max_q_len: int = 0

    @property
    def decode_only(self) -> bool:
        return bool((self.q_lens == 1).all())


class AttentionGroup(Protocol):
    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    name: str  # shown in logs and checked by tests

    def plan(self, rows: PagedRows) -> AttentionGroup: ...
