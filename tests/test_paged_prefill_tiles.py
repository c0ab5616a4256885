"""The native prefill kernel's blocking (keys in tiles of 64, query lanes in blocks of 48 across
the heads sharing a KV head) against the reference backend where its edges fall: chunks of 1, 15,
17 and 513 tokens, prefixes off the page and tile grid, pages that do not divide a tile, sliding
windows narrower and wider than a tile, and head groups that leave a block's lanes part empty."""

from __future__ import annotations

import pytest
import torch

from kvfence.model import kernels
from kvfence.model.attn import PagedRows
from kvfence.model.attn.reference import ReferenceBackend

NULL = 0


@pytest.fixture(scope="module")
def kernel():
    k = kernels.paged_prefill()
    assert k is not None, "the native prefill kernel did not build; see the warning in the log"
    return k


def run_both(kernel, prefixes, q_lens, heads, kv_heads, d, window, page, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx_lens = [p + m for p, m in zip(prefixes, q_lens, strict=True)]
    width = max(-(-n // page) for n in ctx_lens)
    pages = len(ctx_lens) * width + 1
    kc = torch.randn(pages * page, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(pages * page, kv_heads, d, generator=g).to(dtype)
    kc[:page], vc[:page] = 0, 0  # the null page, as the pool keeps it
    table = torch.randperm(pages - 1, generator=g).view(len(ctx_lens), width) + 1
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    rows = PagedRows(
        q_starts=torch.cumsum(q_lens_t, 0) - q_lens_t,
        q_lens=q_lens_t,
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int64),
        page_table=table,
        page_size=page,
        window=window,
        covers_step=True,
    )
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    scale = d**-0.5
    want = ReferenceBackend(torch.device("cpu"), NULL, torch.float32).plan(rows).run(
        q.float(), kc.float(), vc.float(), scale, None
    )
    got = torch.empty_like(q)
    kernel(q, kc, vc, rows.page_table, rows.ctx_lens, rows.q_starts, rows.q_lens, page, scale,
           window, got)
    return got, want


@pytest.mark.parametrize("q_len", [1, 15, 17, 513])
@pytest.mark.parametrize("prefix", [0, 37, 1000])
@pytest.mark.parametrize("page", [16, 7])
def test_chunk_edges_equal_reference(kernel, q_len, prefix, page) -> None:
    got, want = run_both(kernel, [prefix], [q_len], 9, 3, 64, 0, page, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 50, 130])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (7, 1, 16), (2, 2, 40)])
def test_windows_and_head_groups_equal_reference(kernel, window, heads, kv_heads, d) -> None:
    got, want = run_both(kernel, [0, 37, 300], [17, 100, 65], heads, kv_heads, d, window, 7,
                         torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 40])
def test_half_precision_tiles_equal_reference(kernel, dtype, d) -> None:
    got, want = run_both(kernel, [37, 200], [17, 70], 9, 3, d, 0, 7, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
