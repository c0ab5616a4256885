"""Decode steps run per batch-size bucket from static buffers, captured as CUDA graphs on a GPU
(a small model's decode step is launch-bound without them). The bucketing, the padding to the
bucket, the static buffers and the replay are one code path on every device: on CPU the step
runs eagerly from the same buffers, so the CPU tests check it token-exact; only `capture` is
CUDA-only.

A padded row (a bucket's rows past the batch) reads and writes only the null page: its token
is 0 at position 0, its context one slot, its page table all null pages. Its K/V land in the
null page's first slot, which the step zeroes again at its end, so the null page stays what
the pool promises (zeroed, owner-less; kv/pool.py) and no row ever reads another's data.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvfence.model.attention import AttentionMetadata
from kvfence.model.attn import AttentionBackend, PagedRows

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, AttentionMetadata, Sequence[tuple[torch.Tensor, torch.Tensor]]],
                   torch.Tensor]


def buckets(max_bs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16 up to max_bs (and max_bs): a
    batch pads to the next one, so padding wastes at most 15 rows past 16."""
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return sorted({*small, *range(16, max_bs + 1, 16), max_bs})


@dataclass
class DecodeInputs:
    """One decode step's rows, on the host or the device: row i's token, its position, the slot
    its K/V go to, its context length and its pages (padded with the null page)."""

    ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    slots: torch.Tensor  # [n] int64
    ctx_lens: torch.Tensor  # [n] int64
    page_table: torch.Tensor  # [n, P] int64, P <= max_pages


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        *,
        page_size: int,
        window: int,
        null_page: int,
        max_bs: int,
        max_pages: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.forward, self.kv_caches, self.backend = forward, kv_caches, backend
        self.page_size, self.window, self.null_page = page_size, window, null_page
        self.buckets = buckets(max_bs)
        self.max_bs = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.ids = torch.zeros(self.max_bs, **i64)
        self.positions = torch.zeros(self.max_bs, **i64)
        self.slots = torch.zeros(self.max_bs, **i64)
        self.ctx_lens = torch.ones(self.max_bs, **i64)
        self.page_table = torch.full((self.max_bs, max_pages), null_page, **i64)
        self.q_starts = torch.arange(self.max_bs, **i64)
        self.q_lens = torch.ones(self.max_bs, **i64)
        self.hidden = torch.zeros(self.max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.steps_by_bucket: dict[int, int] = {}  # how often each bucket ran (tests, logs)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket that holds n rows; None: more rows than the largest (eager)."""
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, n: int, pages: int) -> bool:
        return n <= self.max_bs and pages <= self.page_table.shape[1]

    def run(self, rows: DecodeInputs) -> torch.Tensor:
        """The rows' hidden states [n, hidden] (a view of the static output: read it before the
        next step). The caller checked fits()."""
        n, p = rows.page_table.shape
        bucket = self.bucket_for(n)
        assert bucket is not None and p <= self.page_table.shape[1], "rows that do not fit"
        self._load(rows, n, p, bucket)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._step(bucket)
        self.steps_by_bucket[bucket] = self.steps_by_bucket.get(bucket, 0) + 1
        return self.hidden[:n]

    def _load(self, rows: DecodeInputs, n: int, p: int, bucket: int) -> None:
        """The rows into the static buffers, and the bucket's rows past them as padding (a row
        that finished last step must not linger there)."""
        for buf, src in ((self.ids, rows.ids), (self.positions, rows.positions),
                         (self.slots, rows.slots), (self.ctx_lens, rows.ctx_lens)):
            buf[:n].copy_(src, non_blocking=True)
        self.page_table[:n, :p].copy_(rows.page_table, non_blocking=True)
        self.page_table[:n, p:].fill_(self.null_page)
        if bucket > n:
            self.ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slots[n:bucket].fill_(self.null_page * self.page_size)
            self.ctx_lens[n:bucket].fill_(1)
            self.page_table[n:bucket].fill_(self.null_page)

    def _step(self, bucket: int) -> None:
        """One decode step of `bucket` rows from the static buffers into self.hidden: no host
        sync when the backend plans on the device (flex), so CUDA can capture it."""
        rows = PagedRows(
            q_starts=self.q_starts[:bucket],
            q_lens=self.q_lens[:bucket],
            ctx_lens=self.ctx_lens[:bucket],
            page_table=self.page_table[:bucket],
            page_size=self.page_size,
            window=self.window,
            covers_step=True,
            max_q_len=1,
        )
        meta = AttentionMetadata(self.positions[:bucket], self.slots[:bucket],
                                 [self.backend.plan(rows)])
        self.hidden[:bucket].copy_(self.forward(self.ids[:bucket], meta, self.kv_caches))
        null = slice(self.null_page * self.page_size, (self.null_page + 1) * self.page_size)
        for k, v in self.kv_caches:
            k[null].zero_()
            v[null].zero_()

    def capture(self) -> None:
        """CUDA only: one graph per bucket, largest first, sharing one memory pool; each bucket
        runs twice eagerly first (compiles flex_attention, warms the allocator) on padding
        rows only, which touch nothing but the null page."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._load(DecodeInputs(*(t[:0] for t in (self.ids, self.positions, self.slots,
                                                      self.ctx_lens)),
                                    self.page_table[:0]), 0, 0, bucket)
            for _ in range(2):
                self._step(bucket)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._step(bucket)
            self.graphs[bucket] = graph
        log.info("decode graphs captured for batch sizes %s", self.buckets)
