"""The native prefill kernel (kvfence/model/kernels/paged_prefill.cpp) against the reference
backend's gather + masked SDPA, on random pages: chunks behind cached prefixes, fresh prompts,
sliding windows, GQA, head sizes off the vector width, the kernel's tile and block edges; float32
tight, bf16 looser. It reads only the slots each query may see, and refuses a table that points
outside the pool."""

from __future__ import annotations

import pytest
import torch

from kvfence.model import kernels
from kvfence.model.attn import PagedRows, select_backend
from kvfence.model.attn.reference import ReferenceBackend

PAGE = 16
NULL = 0


@pytest.fixture(scope="module")
def kernel():
    k = kernels.paged_prefill()
    assert k is not None, "the native prefill kernel did not build; see the warning in the log"
    return k


def random_rows(ctx_lens, q_lens, kv_heads, d, dtype, seed=0, pages=160):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(pages * PAGE, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(pages * PAGE, kv_heads, d, generator=g).to(dtype)
    kc[:PAGE], vc[:PAGE] = 0, 0  # the null page, as the pool keeps it
    width = max(-(-n // PAGE) for n in ctx_lens)
    table = torch.randperm(pages - 1, generator=g)[: len(ctx_lens) * width].view(-1, width) + 1
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    return kc, vc, q_lens_t, table, g


def rows_of(ctx_lens, q_lens, table, window):
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    return PagedRows(
        q_starts=torch.cumsum(q_lens_t, 0) - q_lens_t,
        q_lens=q_lens_t,
        ctx_lens=torch.tensor(ctx_lens, dtype=torch.int64),
        page_table=table,
        page_size=PAGE,
        window=window,
        covers_step=True,
    )


def allowed_slots(ctx_lens, q_lens, table, window, n_slots) -> torch.Tensor:
    """bool [n_slots]: the slots some query of the rows may see (its context, inside the window)."""
    allowed = torch.zeros(n_slots, dtype=torch.bool)
    for b, (n, m) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        t = torch.arange(max(0, n - m - window + 1), n)
        allowed[table[b][t // PAGE] * PAGE + t % PAGE] = True
    return allowed


def run_both(kernel, ctx_lens, q_lens, heads, kv_heads, d, window, dtype, seed=0):
    kc, vc, _, table, g = random_rows(ctx_lens, q_lens, kv_heads, d, dtype, seed)
    q = torch.randn(sum(q_lens), heads, d, generator=g).to(dtype)
    return kernel_and_reference(kernel, q, kc, vc, rows_of(ctx_lens, q_lens, table, window), PAGE)


def kernel_and_reference(kernel, q, kc, vc, rows, page):
    """The kernel's output for `rows` and the float32 reference gather's, side by side."""
    scale = q.shape[-1] ** -0.5
    want = ReferenceBackend(torch.device("cpu"), NULL, torch.float32).plan(rows).run(
        q.float(), kc.float(), vc.float(), scale, None
    )
    got = torch.empty_like(q)
    kernel(q, kc, vc, rows.page_table, rows.ctx_lens, rows.q_starts, rows.q_lens, page, scale,
           rows.window, got)
    return got, want


# Rows: a chunk behind a cached prefix crossing pages, a fresh prompt, one decode-like row, a
# chunk longer than a job's queries and a key tile, a row whose context is exactly whole pages.
CASES = {
    "behind_prefix": ([37, 300, 1, 160], [5, 130, 1, 64]),
    "fresh": ([129, 3], [129, 3]),
}


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 16), (6, 2, 64), (4, 1, 128), (3, 3, 40)])
@pytest.mark.parametrize("window", [0, 7, 100])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_equals_reference_float32(kernel, heads, kv_heads, d, window, case) -> None:
    got, want = run_both(kernel, *CASES[case], heads, kv_heads, d, window, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision_caches(kernel, dtype) -> None:
    got, want = run_both(kernel, *CASES["behind_prefix"], 6, 2, 64, 0, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_kernel_never_reads_a_slot_no_query_may_see(kernel) -> None:
    """NaN in every slot outside the rows' contexts (stale tails, other pages) and before each
    row's earliest window start: the answers are unchanged and finite."""
    ctx_lens, q_lens, window = [37, 300, 20], [5, 130, 20], 40
    kc, vc, _, table, g = random_rows(ctx_lens, q_lens, 2, 64, torch.float32)
    q = torch.randn(sum(q_lens), 6, 64, generator=g)
    rows = rows_of(ctx_lens, q_lens, table, window)
    allowed = allowed_slots(ctx_lens, q_lens, table, window, kc.shape[0])
    poisoned = [c.clone() for c in (kc, vc)]
    for c in poisoned:
        c[~allowed] = float("nan")

    def call(k, v):
        out = torch.empty_like(q)
        kernel(q, k, v, rows.page_table, rows.ctx_lens, rows.q_starts, rows.q_lens, PAGE, 0.1,
               window, out)
        return out

    want, got = call(kc, vc), call(*poisoned)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    # The twin: one more slot of context (the stale next slot) reaches the poison.
    stale = rows_of([n + 1 for n in ctx_lens], [m + 1 for m in q_lens], table, window)
    out = torch.empty(sum(stale.q_lens.tolist()), 6, 64)
    kernel(torch.randn_like(out), *poisoned, stale.page_table, stale.ctx_lens, stale.q_starts,
           stale.q_lens, PAGE, 0.1, window, out)
    assert not torch.isfinite(out).all()


def test_kernel_rejects_tables_outside_the_pool(kernel) -> None:
    kc, vc, _, table, g = random_rows([40], [8], 2, 16, torch.float32)
    q, out = torch.randn(8, 4, 16), torch.empty(8, 4, 16)
    rows = rows_of([40], [8], table, 0)
    bad = table.clone()
    bad[0, 1] = kc.shape[0] // PAGE
    with pytest.raises(RuntimeError, match="out of the pool"):
        kernel(q, kc, vc, bad, rows.ctx_lens, rows.q_starts, rows.q_lens, PAGE, 0.1, 0, out)
    with pytest.raises(RuntimeError, match="page table"):
        kernel(q, kc, vc, table[:, :2], rows.ctx_lens, rows.q_starts, rows.q_lens, PAGE, 0.1, 0,
               out)
    with pytest.raises(RuntimeError, match="outside q"):
        kernel(q, kc, vc, table, rows.ctx_lens, rows.q_starts + 1, rows.q_lens, PAGE, 0.1, 0, out)


def test_native_backend_mixed_step_equals_reference(kernel) -> None:
    """Through the seam: a step of decode rows and prefill chunks, planned by each backend, run
    group after group into one output."""
    ctx_lens, q_lens = [50, 9, 200, 33], [1, 9, 70, 1]
    kc, vc, _, table, g = random_rows(ctx_lens, q_lens, 2, 16, torch.float32)
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    full = rows_of(ctx_lens, q_lens, table, 0)
    outs = {}
    for name in ("auto", "torch"):
        backend = select_backend(name, torch.device("cpu"), torch.float32, torch.float32, NULL)
        out = None
        for sel in ([0, 3], [1, 2]):
            s = torch.tensor(sel)
            rows = PagedRows(full.q_starts[s], full.q_lens[s], full.ctx_lens[s], table[s], PAGE,
                             0, covers_step=False)
            out = backend.plan(rows).run(q, kc, vc, 0.25, out)
        outs[backend.name] = out
    assert set(outs) == {"cpu_native", "reference"}
    torch.testing.assert_close(outs["cpu_native"], outs["reference"], atol=1e-5, rtol=1e-5)


# The blocking (keys in tiles of 128, query lanes in blocks of 48 across the heads sharing a KV
# head) where its edges fall: chunks of 1, 15, 17 and 513 tokens, prefixes off the page and tile
# grid, pages that do not divide a tile, sliding windows narrower and wider than a tile, and head
# groups that leave a block's lanes part empty.
def run_tiles(kernel, prefixes, q_lens, heads, kv_heads, d, window, page, dtype, seed=0):
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
    return kernel_and_reference(kernel, q, kc, vc, rows, page)


@pytest.mark.parametrize("q_len", [1, 15, 17, 513])
@pytest.mark.parametrize("prefix", [0, 37, 1000])
@pytest.mark.parametrize("page", [16, 7])
def test_chunk_edges_equal_reference(kernel, q_len, prefix, page) -> None:
    got, want = run_tiles(kernel, [prefix], [q_len], 9, 3, 64, 0, page, torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 50, 130])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (7, 1, 16), (2, 2, 40)])
def test_windows_and_head_groups_equal_reference(kernel, window, heads, kv_heads, d) -> None:
    got, want = run_tiles(kernel, [0, 37, 300], [17, 100, 65], heads, kv_heads, d, window, 7,
                         torch.float32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 40])
def test_half_precision_tiles_equal_reference(kernel, dtype, d) -> None:
    got, want = run_tiles(kernel, [37, 200], [17, 70], 9, 3, d, 0, 7, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
