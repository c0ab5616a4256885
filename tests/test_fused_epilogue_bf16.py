"""The native epilogue kernels over bfloat16 rows (kvfence/model/kernels/fused_epilogue.cpp, float32
maths, rounded where torch's bf16 ops round): the residual stream, rope and the K/V cache writes
are torch's bf16 path's bits; RMSNorm and silu * up are within one bf16 step of it and almost
always equal (the float32 sum's order and exp's last bit may differ); a bf16 MLP answers with
the kernel exactly as with torch's silu and mul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_fused_epilogue import EPS, ROWS, WIDTHS
from test_rope_store import SENTINEL, SHAPES, TOKENS, assert_only_rows_written, case, torch_path

from kvfence.model import kernels
from kvfence.model.mlp import MLP

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ep():
    e = kernels.fused_epilogue()
    assert e is not None, "the fused epilogue kernel did not build; see the warning in the log"
    return e


def norm_torch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kvfence's (and transformers') bf16 RMSNorm: normalise in float32, round, scale, round."""
    return w * F.rms_norm(x.float(), w.shape, None, EPS).to(BF16)


def assert_within_a_bf16_step(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element within one bf16 step (ulp) of the torch path's, and at most 1% of them
    not equal to it: a float32 sum in another order or exp's last bit moves a rounding now and
    then, a rounding left out or added moves many."""
    assert y.dtype == BF16 and y.shape == ref.shape
    r = ref.float()
    ulp = torch.exp2(torch.floor(torch.log2(r.abs().clamp(min=1e-30))) - 7)
    err = (y.float() - r).abs()
    assert (err <= ulp).all(), f"max error {(err / ulp).max().item():.3g} bf16 steps"
    unequal = (y != ref).float().mean().item()
    assert unequal <= 0.01, f"{unequal:.1%} of the elements differ from the torch path's"


def bf16_inputs(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 3
    d = torch.randn(rows, n, generator=g)
    return x.to(BF16), d.to(BF16), (torch.rand(n, generator=g) + 0.5).to(BF16)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", WIDTHS)
def test_bf16_add_rms_norm_matches_torch(ep, rows, n) -> None:
    x, delta, w = bf16_inputs(rows, n, rows * 7919 + n)
    stream = x.clone()
    y = ep.add_rms_norm(stream, delta, w, EPS)
    assert torch.equal(stream, x + delta)  # torch's bf16 add: the same rounding
    assert_within_a_bf16_step(y, norm_torch(x + delta, w))


@pytest.mark.parametrize("rows", [1, 300])
def test_bf16_rms_norm_without_delta_leaves_x_alone(ep, rows) -> None:
    x, _, w = bf16_inputs(rows, 576, rows)
    stream = x.clone()
    y = ep.add_rms_norm(stream, None, w, EPS)
    assert torch.equal(stream, x)
    assert_within_a_bf16_step(y, norm_torch(x, w))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", WIDTHS + [1536])
def test_bf16_silu_mul_matches_torch(ep, rows, n) -> None:
    g = torch.Generator().manual_seed(rows * 104729 + n)
    gate_up = (torch.randn(rows, 2 * n, generator=g) * 4).to(BF16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_within_a_bf16_step(ep.silu_mul(gate_up, n), F.silu(gate).mul_(up))


def test_bf16_step_check_catches_a_wrong_kernel(ep) -> None:
    """The twin of the tolerance: one rounding too few (the weight applied in float32 before
    rounding), an eps left out, or gate and up swapped all fail it."""
    x, _, w = bf16_inputs(64, 576, 0)
    x = (x.float() * 1e-3).to(BF16)  # small rows, where eps counts
    no_eps = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True)) * w.float())
    one_rounding = F.rms_norm(x.float(), w.shape, w.float(), EPS)
    for wrong in (no_eps, one_rounding):
        with pytest.raises(AssertionError, match="max error|differ"):
            assert_within_a_bf16_step(wrong.to(BF16), norm_torch(x, w))
    gate_up = (torch.randn(3, 2 * 17) * 4).to(BF16)
    swapped = torch.cat((gate_up[:, 17:], gate_up[:, :17]), dim=1)
    gate, up = gate_up.chunk(2, dim=-1)
    with pytest.raises(AssertionError, match="max error|differ"):
        assert_within_a_bf16_step(ep.silu_mul(swapped, 17), F.silu(gate) * up)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h, kvh, d", SHAPES)
def test_bf16_rope_store_equals_torch_rope_and_index_copy(ep, t, h, kvh, d) -> None:
    qkv, rot, slots, caches = case(t, h, kvh, d, seed=t * 7919 + d)
    qkv = qkv.to(BF16)
    kc, vc = (c.to(BF16) for c in caches)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = ep.rope_store(qkv, rot.cos, rot.sin, h, kc, vc, slots)
    q_ref = torch_path(qkv, rot, h, kvh, d, kc_ref, vc_ref, slots)
    assert q.dtype == BF16 and q.shape == (t, h, d) and q.is_contiguous()
    assert torch.equal(q, q_ref)
    assert torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)
    for cache in (kc, vc):
        assert_only_rows_written(cache, slots)


def test_bf16_kernels_refuse_mixed_dtypes(ep) -> None:
    x = torch.ones(2, 8, dtype=BF16)
    with pytest.raises(RuntimeError, match="weight"):
        ep.add_rms_norm(x, None, torch.ones(8), EPS)
    with pytest.raises(RuntimeError, match="delta"):
        ep.add_rms_norm(x, torch.ones(2, 8), torch.ones(8, dtype=BF16), EPS)
    qkv, rot, slots, (kc, vc) = case(2, 9, 3, 64, seed=6)
    with pytest.raises(RuntimeError, match="caches must be"):
        ep.rope_store(qkv.to(BF16), rot.cos, rot.sin, 9, kc, vc, slots)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ep.rope_store(qkv.to(BF16), rot.cos.to(BF16), rot.sin, 9, kc.to(BF16), vc.to(BF16), slots)
    assert (kc == SENTINEL).all()


def test_bf16_mlp_with_the_kernel_equals_torch_silu_and_mul(ep) -> None:
    torch.manual_seed(0)
    mlp = MLP(96, 200).to(BF16)
    mlp.fuse()
    x = torch.randn(13, 96).to(BF16)
    with torch.inference_mode():
        assert torch.equal(mlp(x, ep), mlp(x))
