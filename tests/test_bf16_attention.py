"""bf16 attention on hosts with bf16 dot products (vdpbf16ps): the native prefill and decode
kernels then compute Q.K and P.V from bf16 pairs, P rounded to bf16, sums in float32. Both that
path and the widening one every host has (`widened=True`) must give the float32 attention over
the bf16 values to bf16 rounding, at the pair layouts' edges (odd tiles and contexts, a lone last
key, head sizes of one to four 32-element vectors, one the dot path leaves to widening), and
read no slot a query may not see. On a host without the instructions both names run the
widening path and the tests hold the same.

Tolerance: the output is rounded to bf16 (a relative 2^-9) and so are the probabilities P.V
takes (2^-9 each, averaging out over keys); atol covers answers near 0, where the outputs' own
rounding is not relative. The reference is float32 SDPA over the same bf16 pages."""

from __future__ import annotations

import pytest
import torch
from test_native_kernel import PAGE, poisoned_outside, random_case, reference
from test_paged_prefill import kernel_and_reference, run_tiles

from kvfence.model import kernels

TOL = {"atol": 1e-2, "rtol": 2**-7}


@pytest.fixture(scope="module", params=[False, True], ids=["dot", "widened"])
def prefill(request):
    k = kernels.paged_prefill(widened=request.param)
    assert k is not None, "the native prefill kernel did not build; see the warning in the log"
    return k


@pytest.fixture(scope="module", params=[False, True], ids=["dot", "widened"])
def decode(request):
    k = kernels.paged_decode(widened=request.param)
    assert k is not None, "the native decode kernel did not build; see the warning in the log"
    return k


# Chunks of 1, 16 and 129 tokens (a lone last key in a tile, a tile and one), behind prefixes
# off the pair, page and tile grid; windows narrower and wider than a tile.
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 1, 128), (6, 2, 32), (3, 1, 96),
                                              (3, 3, 40)])
@pytest.mark.parametrize("window", [0, 3, 130])
def test_prefill_bf16_equals_reference(prefill, heads, kv_heads, d, window) -> None:
    got, want = run_tiles(prefill, [0, 37, 200], [129, 16, 1], heads, kv_heads, d, window, 7,
                          torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, **TOL)


def test_prefill_long_chunk_behind_prefix_equals_reference(prefill) -> None:
    got, want = run_tiles(prefill, [1000], [513], 9, 3, 64, 0, 16, torch.bfloat16)
    torch.testing.assert_close(got.float(), want, **TOL)


def test_prefill_bf16_reads_no_slot_no_query_may_see(prefill) -> None:
    """NaN outside the rows' contexts and windows: the answers are unchanged and finite. A slot
    past the context would enter a P.V pair as a lone last key's partner, if the kernel read it."""
    from test_paged_prefill import allowed_slots, random_rows, rows_of

    ctx_lens, q_lens, window = [37, 301, 20], [5, 131, 19], 40
    kc, vc, _, table, g = random_rows(ctx_lens, q_lens, 3, 64, torch.bfloat16)
    q = torch.randn(sum(q_lens), 9, 64, generator=g).bfloat16()
    rows = rows_of(ctx_lens, q_lens, table, window)
    allowed = allowed_slots(ctx_lens, q_lens, table, window, kc.shape[0])
    poisoned = [c.clone() for c in (kc, vc)]
    for c in poisoned:
        c[~allowed] = float("nan")
    want, _ = kernel_and_reference(prefill, q, kc, vc, rows, PAGE)
    got, _ = kernel_and_reference(prefill, q, *poisoned, rows, PAGE)
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, want)
    # The twin: one more slot of context (the stale next slot) reaches the poison.
    stale = rows_of([n + 1 for n in ctx_lens], [m + 1 for m in q_lens], table, window)
    q2 = torch.randn(sum(stale.q_lens.tolist()), 9, 64, generator=g).bfloat16()
    out, _ = kernel_and_reference(prefill, q2, *poisoned, stale, PAGE)
    assert not torch.isfinite(out.float()).all()


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 1, 128), (6, 2, 32), (3, 1, 96),
                                              (4, 2, 48)])
@pytest.mark.parametrize("window", [0, 7])
def test_decode_bf16_equals_reference(decode, heads, kv_heads, d, window) -> None:
    ctx = [1, 2, 15, 16, 17, 31, 33, 40, 64, 5, 9, 70, 300]
    q, kc, vc, table, lens = random_case(heads, kv_heads, ctx, torch.bfloat16, pages=260, d=d)
    got = decode(q, kc, vc, table, lens, PAGE, d**-0.5, window)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, kc, vc, table, lens, window), **TOL)
    kc_p, vc_p = poisoned_outside(kc, vc, table, lens, window)
    assert torch.equal(decode(q, kc_p, vc_p, table, lens, PAGE, d**-0.5, window), got)


def test_decode_bf16_twin_reading_one_slot_past_the_context_shows_the_poison(decode) -> None:
    """The poison check can fail: with odd contexts, one more slot (a lone last key's partner,
    were it read from the page) reaches a NaN."""
    q, kc, vc, table, lens = random_case(9, 3, [15, 33, 1], torch.bfloat16, pages=80, d=64)
    kc_p, vc_p = poisoned_outside(kc, vc, table, lens, 0)
    out = decode(q, kc_p, vc_p, table, lens + 1, PAGE, 0.125, 0)
    assert not torch.isfinite(out.float()).all()


@pytest.mark.skipif(
    not kernels.has_bf16_dot(), reason="no bf16 dot products here: both paths are the widening one"
)
def test_dot_and_widened_paths_agree_to_bf16_rounding() -> None:
    """The two paths differ only in where they round (P to bf16, the order of float32 sums):
    their answers lie within a few bf16 steps of each other."""
    dot, wide = kernels.paged_decode(), kernels.paged_decode(widened=True)
    q, kc, vc, table, lens = random_case(9, 3, [300, 77, 1, 2], torch.bfloat16, pages=80, d=64)
    a = dot(q, kc, vc, table, lens, PAGE, 0.125, 0).float()
    b = wide(q, kc, vc, table, lens, PAGE, 0.125, 0).float()
    torch.testing.assert_close(a, b, **TOL)
    got, _ = run_tiles(kernels.paged_prefill(), [37], [300], 9, 3, 64, 0, 16, torch.bfloat16)
    ref, _ = run_tiles(kernels.paged_prefill(widened=True), [37], [300], 9, 3, 64, 0, 16,
                       torch.bfloat16)
    torch.testing.assert_close(got.float(), ref.float(), **TOL)
