"""The native kernels whose threads claim chunks of work as they free up
(kvfence/model/kernels/claim.h: the packed GEMM's panels, the fused epilogues' rows, decode
attention's rows) give the same bits on one thread as on two: which thread computes a chunk
changes no value, so token-exactness cannot depend on the host's load."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvfence.model import kernels
from kvfence.model.linear import to_panels


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def same_on_one_and_two_threads(threads: Callable[[int], None], run: Callable[[], object]) -> None:
    threads(1)
    one = run()
    threads(2)
    two = run()
    for a, b in zip(one if isinstance(one, tuple) else (one,),
                    two if isinstance(two, tuple) else (two,), strict=True):
        assert torch.equal(a, b)


# Panel counts below, at and above the threads, row counts of one tile and of several; bf16
# where the host has its dot products (the same panel loop).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, n", [(1, 48), (3, 200), (32, 960), (130, 577)])
def test_packed_gemm_panels_claimed_on_any_thread_give_the_same_bits(threads, m, n, dtype) -> None:
    gemm = kernels.packed_gemm() if dtype == torch.float32 else kernels.packed_gemm_bf16()
    if gemm is None and dtype == torch.bfloat16:
        pytest.skip("no bf16 dot products on this host: the bf16 GEMM is not built")
    assert gemm is not None
    torch.manual_seed(m + n)
    x, w_t = torch.randn(m, 96, dtype=dtype), torch.randn(96, n, dtype=dtype)
    panels = to_panels(w_t, gemm.width)
    same_on_one_and_two_threads(threads, lambda: gemm.matmul(x, panels, n))


# Rows below a grain (the calling thread alone) and far above it (claimed in chunks).
@pytest.mark.parametrize("rows", [4, 300, 1031])
def test_epilogue_rows_claimed_on_any_thread_give_the_same_bits(threads, rows) -> None:
    ep = kernels.fused_epilogue()
    assert ep is not None
    torch.manual_seed(rows)
    n, heads, kv_heads, d = 576, 9, 3, 64
    x0, delta, w = torch.randn(rows, n), torch.randn(rows, n), torch.randn(n)
    gate_up = torch.randn(rows, 2 * 1536)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d)
    cos, sin = torch.randn(rows, 1, d), torch.randn(rows, 1, d)
    slots = torch.randperm(2 * rows)[:rows]

    def run() -> tuple[torch.Tensor, ...]:
        x = x0.clone()
        normed = ep.add_rms_norm(x, delta, w, 1e-5)
        k_cache = torch.zeros(2 * rows, kv_heads, d)
        v_cache = torch.zeros(2 * rows, kv_heads, d)
        q = ep.rope_store(qkv, cos, sin, heads, k_cache, v_cache, slots)
        return x, normed, ep.silu_mul(gate_up, 1536), q, k_cache, v_cache

    same_on_one_and_two_threads(threads, run)


@pytest.mark.parametrize("batch", [1, 3, 32])
def test_decode_rows_claimed_on_any_thread_give_the_same_bits(threads, batch) -> None:
    decode = kernels.paged_decode()
    assert decode is not None
    torch.manual_seed(batch)
    heads, kv_heads, d, page, pages = 9, 3, 64, 16, 20
    k_cache = torch.randn(batch * pages * page + page, kv_heads, d)
    v_cache = torch.randn_like(k_cache)
    table = (torch.randperm(batch * pages) + 1).view(batch, pages)
    ctx = torch.randint(1, pages * page + 1, (batch,))
    q = torch.randn(batch, heads, d)
    same_on_one_and_two_threads(
        threads, lambda: decode(q, k_cache, v_cache, table, ctx, page, d**-0.5, 0)
    )
