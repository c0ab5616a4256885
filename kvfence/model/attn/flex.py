"""The flex backend: torch's flex_attention over the whole physical KV pool, with a block mask
built from the page table, so each row reads its own pages in place (decode rows and prefill
chunks behind a cached prefix alike). The default on CUDA, where flex_attention compiles to a
fused kernel; on CPU it runs unfused and is what the CPU tests check token-exact against the
reference, through the very code a GPU runs.

Every step is plain tensor ops with no host sync once `max_q_len` is known, so a decode step's
plan can run inside a captured CUDA graph (kvfence/engine/decode_graphs.py).

The pool is one sequence of `slots` keys; batch row b's queries are its chunk (padded to the
step's longest). Its block mask lists exactly b's pages as KV blocks (a KV block is a page), and
the mask_mod maps a physical slot back to the row's logical position through `logical` [B,
pages] (page -> index in b's table, -1 for a page that is not b's), so a slot of another row's
page, a stale tail past ctx_len or a key outside the window is never attended (I2).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvfence.model.attn.backend import PagedRows

# Query block of the block mask (the KV block is the page): 16 for decode rows and short
# chunks, as vLLM's flex backend; a longer chunk lists the same pages in every query block, so
# bigger blocks only shrink the [rows, q blocks, pages] index the step builds.
Q_BLOCK = 16
Q_BLOCK_LONG = 128

# CPU runs flex_attention unfused on purpose (exactness, not speed): its warning says so each run.
warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")


@cache
def _kernel(device_type: str) -> Callable[..., torch.Tensor]:
    """flex_attention compiled to a fused kernel on CUDA (once per process); eager elsewhere."""
    if device_type == "cuda":
        return torch.compile(flex_attention, dynamic=False)  # type: ignore[return-value]
    return flex_attention


@dataclass
class FlexGroup:
    """One step's rows as flex_attention's batch: built on the device by plan(); the block mask
    is made on the first layer's run (it needs the pool's page count) and reused by the rest."""

    q_index: torch.Tensor  # [B, Lq] int64 into the flat token dim (padding -> the row's start)
    q_valid: torch.Tensor  # [B, Lq] bool
    q_pos: torch.Tensor  # [B, Lq] int64 absolute position of each query (padding -> -1)
    page_table: torch.Tensor  # [B, P] int64
    page_valid: torch.Tensor  # [B, P] bool: the pages that hold the row's context
    page_size: int
    window: int
    identity: bool  # decode rows covering the step in order: q_index is arange(T)
    flat_valid_index: torch.Tensor  # [N] q_index[q_valid]
    valid_rows: torch.Tensor  # [N] rows of the [B * Lq] answers that are real
    kernel: Callable[..., torch.Tensor]
    _mask: BlockMask | None = field(default=None, repr=False)

    def block_mask(self, slots: int) -> BlockMask:
        if self._mask is None:
            self._mask = paged_block_mask(
                self.page_table, self.page_valid, self.q_pos, self.page_size, self.window, slots
            )
        return self._mask

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        b, lq = self.q_index.shape
        _, h, d = q.shape
        qg = q.index_select(0, self.q_index.view(-1)).view(b, lq, h, d).transpose(1, 2)
        # [slots, KVH, D] -> [1, KVH, slots, D]: a view, the pool is read in place.
        kg, vg = (c.unsqueeze(0).transpose(1, 2) for c in (k_cache, v_cache))
        o = self.kernel(
            qg, kg, vg, block_mask=self.block_mask(k_cache.shape[0]), scale=scale,
            enable_gqa=True,
        )
        o = o.transpose(1, 2).reshape(b * lq, h, d)
        if self.identity and out is None:
            return o
        o = o.index_select(0, self.valid_rows)
        if out is None:
            out = torch.empty_like(q)
        return out.index_copy_(0, self.flat_valid_index, o)


def paged_block_mask(
    page_table: torch.Tensor,
    page_valid: torch.Tensor,
    q_pos: torch.Tensor,
    page_size: int,
    window: int,
    slots: int,
) -> BlockMask:
    """The block mask of rows over a pool of `slots` keys: row b's KV blocks are its valid pages,
    and a key is attended iff it lies in one of them at a position <= the query's (and inside
    the window). Tensor ops only: no host sync."""
    b, p = page_table.shape
    n_pages = slots // page_size
    dev = page_table.device
    cols = torch.arange(p, device=dev).expand(b, p)
    # Invalid entries (the null page past a row's context) scatter into a dump column.
    logical = torch.full((b, n_pages + 1), -1, dtype=torch.int32, device=dev)
    dest = torch.where(page_valid, page_table, n_pages)
    logical.scatter_(1, dest, torch.where(page_valid, cols, -1).to(torch.int32))
    logical = logical[:, :n_pages]
    lq = q_pos.shape[1]
    q_block = Q_BLOCK if lq <= Q_BLOCK else Q_BLOCK_LONG
    q_blocks = (lq + q_block - 1) // q_block
    kv_indices = torch.zeros((b, 1, q_blocks, n_pages), dtype=torch.int32, device=dev)
    kv_indices[:, 0, :, :p] = torch.where(page_valid, page_table, 0).to(torch.int32)[:, None, :]
    kv_num = page_valid.sum(1, dtype=torch.int32)[:, None, None].expand(b, 1, q_blocks)

    def mask_mod(
        bi: torch.Tensor, hi: torch.Tensor, qi: torch.Tensor, ki: torch.Tensor
    ) -> torch.Tensor:
        lg = logical[bi, ki // page_size]
        pos = lg * page_size + ki % page_size
        qp = q_pos[bi, qi]
        ok = (lg >= 0) & (pos <= qp)
        if window:
            ok = ok & (pos > qp - window)
        return ok

    return BlockMask.from_kv_blocks(
        kv_num.contiguous(),
        kv_indices,
        BLOCK_SIZE=(q_block, page_size),
        mask_mod=mask_mod,
        seq_lengths=(q_pos.shape[1], slots),
        compute_q_blocks=False,
    )


@dataclass(frozen=True)
class FlexBackend:
    device: torch.device
    name: str = "flex"

    def plan(self, rows: PagedRows) -> FlexGroup:
        """Rows' tensors may be on the host or already on the device (a captured decode step's
        static buffers): either way no host sync when rows.max_q_len is set."""
        dev = self.device
        q_starts, q_lens, ctx = (t.to(dev) for t in (rows.q_starts, rows.q_lens, rows.ctx_lens))
        table = rows.page_table.to(dev)
        lq = rows.max_q_len or int(rows.q_lens.max())
        ar = torch.arange(lq, device=dev)[None, :]
        q_valid = ar < q_lens[:, None]
        q_index = q_starts[:, None] + torch.where(q_valid, ar, 0)
        q_pos = torch.where(q_valid, (ctx - q_lens)[:, None] + ar, -1)
        pages = (ctx + rows.page_size - 1) // rows.page_size
        page_valid = torch.arange(table.shape[1], device=dev)[None, :] < pages[:, None]
        flat = q_valid.view(-1)
        return FlexGroup(
            q_index=q_index,
            q_valid=q_valid,
            q_pos=q_pos,
            page_table=table,
            page_valid=page_valid,
            page_size=rows.page_size,
            window=rows.window,
            identity=rows.covers_step and lq == 1,
            flat_valid_index=q_index.view(-1)[flat] if lq > 1 else q_index.view(-1),
            valid_rows=flat.nonzero().view(-1) if lq > 1 else torch.arange(len(flat), device=dev),
            kernel=_kernel(dev.type),
        )
