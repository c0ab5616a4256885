"""The native bf16 packed matmul (kvfence/model/kernels/packed_gemm.cpp on the host's bf16 dot
products, K in pairs): within bf16 rounding of a float32 matmul of the same bf16 inputs and of
oneDNN's bf16 matmul, for odd K, ragged N and 1-70 rows with a bias; a layout with the pairs'
halves swapped is caught; an odd K's last pair never reads past x; bf16 projections pack
(rows for a tied embedding, LoRA on top) and the engine's bf16 on CPU runs them."""

from __future__ import annotations

import pytest
import torch

from kvfence.model import kernels
from kvfence.model.linear import Projection, to_panels

pytestmark = pytest.mark.skipif(
    not kernels.has_bf16_dot(), reason="no bf16 dot products here: bf16 projections run oneDNN"
)

U_BF16 = 2.0**-8  # bf16's unit roundoff: 8 significant bits, rounded to nearest
U_F32 = 2.0**-24


@pytest.fixture(scope="module")
def gemm():
    g = kernels.packed_gemm_bf16()
    assert g is not None, "the packed gemm kernel did not build its bf16 path on a bf16 host"
    return g


def excess(y: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None,
           slack: float = 1.0) -> float:
    """The largest |y - ref| over its bound, elementwise; <= 1 passes. ref: x @ w_t + bias in
    float32 over the same bf16 values. Bound: y's one rounding to bf16 (U_BF16 |ref|) plus two
    float32 sums of K + 1 terms (y's and ref's), each within (K + 1) U_F32 sum|terms|."""
    xf, wf = x.float(), w_t.float()
    bf = torch.zeros(w_t.shape[1]) if bias is None else bias.float()
    ref = xf @ wf + bf
    mag = xf.abs() @ wf.abs() + bf.abs()
    k = x.shape[1]
    bound = slack * (U_BF16 * ref.abs() + 2 * (k + 1) * U_F32 * mag) + 1e-30
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    return float(((y.float() - ref).abs() / bound).max())


def random_case(m: int, k: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w_t = torch.randn(k, n, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return x, w_t, bias


# m: one register tile (<= 8), two tiles walking K in blocks (9..16), whole-panel walks (> 16)
# and more than one group of 64 rows; k: odd and even, one pair, and K blocks (64 pairs) with a
# ragged last one; n: one column, ragged and whole panels.
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 17, 33, 64, 65, 70])
@pytest.mark.parametrize("k, n", [(1, 5), (2, 48), (37, 100), (129, 241), (300, 97), (576, 1)])
def test_bf16_packed_matmul_within_rounding_of_float32_and_onednn(gemm, m, k, n) -> None:
    x, w_t, bias = random_case(m, k, n, m * 1000 + k + n)
    y = gemm.matmul(x, to_panels(w_t, gemm.width), n, bias)
    assert excess(y, x, w_t, bias) <= 1.0
    y0 = gemm.matmul(x, to_panels(w_t, gemm.width), n)
    assert excess(y0, x, w_t, None) <= 1.0
    if torch.backends.mkldnn.is_available():
        w = torch.ops.mkldnn._reorder_linear_weight(w_t.t().contiguous(), None)
        ref = torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        # both within the bound of the exact sum: within twice it of each other
        assert excess(y, x, w_t, bias, slack=2.0) <= 1.0
        close = (y.float() - ref.float()).abs()
        ok = close <= 2 * (U_BF16 * ref.float().abs() + 2 * (k + 1) * U_F32 *
                           ((x.float().abs() @ w_t.float().abs()) + bias.float().abs()))
        assert bool(ok.all())


@pytest.mark.parametrize("k", [37, 300])
def test_swapped_pairs_are_caught(gemm, k) -> None:
    """The twin: panels whose pairs hold (w[2j + 1], w[2j]) multiply x[2j] by w[2j + 1]; the
    bound above catches that by far."""
    x, w_t, bias = random_case(5, k, 100, k)
    panels = to_panels(w_t, gemm.width)
    assert excess(gemm.matmul(x, panels, 100, bias), x, w_t, bias) <= 1.0
    swapped = panels.flip(-1).contiguous()
    assert excess(gemm.matmul(x, swapped, 100, bias), x, w_t, bias) > 10.0


def test_every_output_column_is_its_own_weight_column(gemm) -> None:
    """A one-hot weight at (k, col) shows x's column k in exactly output column col: pair order,
    panel order and the ragged last panel are right, and padding never leaks into a column."""
    k, n = 33, 100
    x = torch.arange(1.0, k + 1).repeat(3, 1).bfloat16()  # small integers: exact in bf16
    for row, col in [(0, 0), (1, 0), (31, 47), (32, 48), (2, 95), (32, 99), (17, 96)]:
        w_t = torch.zeros(k, n, dtype=torch.bfloat16)
        w_t[row, col] = 1.0
        y = gemm.matmul(x, to_panels(w_t, gemm.width), n)
        expect = torch.zeros(3, n, dtype=torch.bfloat16)
        expect[:, col] = float(row + 1)
        assert torch.equal(y, expect), (row, col)


def test_odd_k_never_reads_past_the_row(gemm) -> None:
    """An odd K's last pair is x[K - 1] and a zero: the value after the row (the next row's
    first, or past the buffer) is never read. Here past the last row lies a NaN, which any read
    of it would spread (NaN * 0 is NaN)."""
    m, k, n = 3, 7, 50
    x, w_t, _ = random_case(m, k, n, 1)
    buf = torch.full((m * k + 1,), float("nan"), dtype=torch.bfloat16)
    buf[: m * k] = x.flatten()
    xv = buf[: m * k].view(m, k)
    y = gemm.matmul(xv, to_panels(w_t, gemm.width), n)
    assert bool(torch.isfinite(y.float()).all())
    assert excess(y, x, w_t, None) <= 1.0


def test_rounding_is_to_nearest_even(gemm) -> None:
    """Sums exact in float32 that lie on and beside the midpoint of two bf16 values: y holds them
    rounded as torch rounds float32 to bf16 (to nearest, ties to even), not truncated or
    rounded half up."""
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    # column c sums 1 + w[1, c]: 1 + 2^-8 (a tie, to 1), 1 + 3 * 2^-8 (a tie, to 1 + 2^-6),
    # 1 + 2^-8 + 2^-15 (past the tie, to 1 + 2^-7), 1 + 2^-9 (below it, to 1)
    second = [2.0**-8, 3 * 2.0**-8, 2.0**-8 + 2.0**-15, 2.0**-9]
    w = torch.tensor([[1.0] * 4, second], dtype=torch.bfloat16)
    y = gemm.matmul(x, to_panels(w, gemm.width), 4)
    exact = x.float() @ w.float()
    assert exact.tolist()[0] == [1.0 + v for v in second]  # the sums themselves are exact
    assert torch.equal(y, exact.bfloat16())
    assert y.float().tolist()[0] == [1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7, 1.0]


def test_bf16_projection_packs_with_rows_bias_and_lora(gemm) -> None:
    torch.manual_seed(0)
    w = torch.randn(130, 25).bfloat16()  # [out, in], odd in
    bias = torch.randn(130).bfloat16()
    plain, packed = Projection(w.t().contiguous()), Projection(w.t().contiguous())
    packed.pack(gemm)
    assert packed.w_t is None and packed.panels is not None
    assert packed.nbytes() == 3 * 13 * 48 * 2 * 2  # ceil(130 / 48) panels x ceil(25 / 2) pairs
    x = torch.randn(6, 25).bfloat16()
    assert excess(packed(x, bias), x, w.t(), bias) <= 1.0
    assert excess(plain(x, bias), x, w.t(), bias) <= 1.0
    ids = torch.tensor([0, 47, 48, 129, 5, 5])
    assert torch.equal(packed.rows(ids), w[ids])
    delta = torch.randn(25, 130).bfloat16()
    packed.lora = lambda xin, y: y.add_(xin @ delta)
    with_lora = packed(x, bias)
    packed.lora = None
    torch.testing.assert_close(with_lora, packed(x, bias) + x @ delta, rtol=2**-7, atol=2**-5)


def test_bf16_shapes_are_checked(gemm) -> None:
    panels = to_panels(torch.randn(15, 60).bfloat16(), gemm.width)  # 8 pairs
    with pytest.raises(RuntimeError, match="packed shape"):
        gemm.matmul(torch.randn(2, 17).bfloat16(), panels, 60)
    with pytest.raises(RuntimeError, match="dtype"):
        gemm.matmul(torch.randn(2, 15), panels, 60)
    with pytest.raises(RuntimeError, match="bias"):
        gemm.matmul(torch.randn(2, 15).bfloat16(), panels, 60, torch.zeros(60))
