"""The CPU backend: the native kernels (kvfence/model/kernels) read each row's K/V in place from
its pages, paged_decode.cpp for decode rows and paged_prefill.cpp for prefill chunks behind any
cached prefix. Neither copies a context nor builds a mask, so a chunk's memory does not grow
with the context behind it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfence.model.attn.backend import PagedRows


@dataclass
class NativeDecodeGroup:
    """Decode rows (one query each): the kernel reads slots [max(0, ctx - window), ctx) of each
    row's pages and nothing else."""

    q_index: torch.Tensor | None  # [B] int64 into the flat token dim; None: every token, in order
    page_table: torch.Tensor  # [B, P] int64
    ctx_lens: torch.Tensor  # [B] int64
    kernel: Callable[..., torch.Tensor]
    page_size: int
    window: int  # 0: no sliding window

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        rows = q.contiguous() if self.q_index is None else q.index_select(0, self.q_index)
        o = self.kernel(
            rows, k_cache, v_cache, self.page_table, self.ctx_lens, self.page_size, scale,
            self.window,
        )
        if self.q_index is None:  # a decode-only step: the kernel's output is the answer
            return o
        if out is None:
            out = torch.empty_like(q)
        return out.index_copy_(0, self.q_index, o)


@dataclass
class NativePrefillGroup:
    """Prefill chunks: the kernel writes each row's answers straight into out's rows."""

    rows: PagedRows
    kernel: Callable[..., None]

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        q = q.contiguous()
        if out is None:
            out = torch.empty_like(q)
        r = self.rows
        self.kernel(
            q, k_cache, v_cache, r.page_table, r.ctx_lens, r.q_starts, r.q_lens, r.page_size,
            scale, r.window, out,
        )
        return out


@dataclass(frozen=True)
class CpuNativeBackend:
    decode: Callable[..., torch.Tensor]
    prefill: Callable[..., None]
    name: str = "cpu_native"

    def plan(self, rows: PagedRows) -> NativeDecodeGroup | NativePrefillGroup:
        if rows.decode_only:
            return NativeDecodeGroup(
                q_index=None if rows.covers_step else rows.q_starts,
                page_table=rows.page_table.contiguous(),
                ctx_lens=rows.ctx_lens,
                kernel=self.decode,
                page_size=rows.page_size,
                window=rows.window,
            )
        return NativePrefillGroup(rows, self.prefill)
