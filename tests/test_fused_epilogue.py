"""The native float32 epilogue kernels (kvfence/model/kernels/fused_epilogue.cpp): residual add +
RMSNorm and silu(gate) * up equal float64 references to float32 rounding at every row count
(serial and threaded) and ragged widths, and the engine answers the same with and without them,
token-exact with transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts
from test_engine_equivalence import GREEDY, run_staggered

from kvfence.engine.llm import LLM
from kvfence.model import kernels

ROWS = [1, 2, 7, 8, 9, 33, 300]  # 300 rows of width 1001 split over the threads
WIDTHS = [1, 17, 576, 1001]
EPS = 1e-5


@pytest.fixture(scope="module")
def ep():
    e = kernels.fused_epilogue()
    # CI installs g++ (.ci/run): a missing kernel there is a failure, not a skip.
    assert e is not None, "the fused epilogue kernel did not build; see the warning in the log"
    return e


def norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


def silu_mul_ref(gate_up: torch.Tensor, n: int) -> torch.Tensor:
    g, u = gate_up.double()[:, :n], gate_up.double()[:, n:]
    return g * torch.sigmoid(g) * u


def assert_float32_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Within a few float32 ulps of each element's float64 value (relative, plus a floor for
    elements near zero)."""
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert (err <= 4e-6 * ref.abs() + 1e-6).all(), f"max error {err.max().item():.3g}"


def inputs(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * 3
    return x, torch.randn(rows, n, generator=g), torch.rand(n, generator=g) + 0.5


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", WIDTHS)
def test_add_rms_norm_equals_float64(ep, rows, n) -> None:
    x, delta, w = inputs(rows, n, rows * 7919 + n)
    stream = x.clone()
    y = ep.add_rms_norm(stream, delta, w, EPS)
    # The residual stream is updated in place with exactly torch's float32 sum.
    assert torch.equal(stream, x + delta)
    assert_float32_close(y, norm_ref(x + delta, w))


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_rms_norm_without_delta_leaves_x_alone(ep, rows) -> None:
    x, _, w = inputs(rows, 1001, rows)
    stream = x.clone()
    y = ep.add_rms_norm(stream, None, w, EPS)
    assert torch.equal(stream, x)
    assert_float32_close(y, norm_ref(x, w))


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", WIDTHS + [1536])
def test_silu_mul_equals_float64(ep, rows, n) -> None:
    g = torch.Generator().manual_seed(rows * 104729 + n)
    gate_up = torch.randn(rows, 2 * n, generator=g) * 4
    assert_float32_close(ep.silu_mul(gate_up, n), silu_mul_ref(gate_up, n))


def test_silu_mul_saturates_like_torch_at_large_gates(ep) -> None:
    """exp(-gate) is clamped before it overflows: silu(-200) is 0, silu(200) is 200."""
    gate = torch.tensor([[-1e4, -200.0, -88.0, -20.0, 0.0, 20.0, 88.0, 200.0, 1e4]])
    gate_up = torch.cat((gate, torch.full_like(gate, 2.0)), dim=1)
    y = ep.silu_mul(gate_up, gate.shape[1])
    assert torch.isfinite(y).all()
    assert_float32_close(y, silu_mul_ref(gate_up, gate.shape[1]))


def test_float64_check_catches_a_wrong_kernel(ep) -> None:
    """The tolerance is tight enough to matter: an eps left out, a mean over one column too
    few, or gate and up swapped all fail it."""
    x, _, w = inputs(4, 37, 0)
    x = x * 1e-3  # small rows, where eps counts
    no_eps = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w
    short = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / 36 + EPS) * w
    for wrong in (no_eps, short):
        with pytest.raises(AssertionError, match="max error"):
            assert_float32_close(wrong, norm_ref(x, w))
    gate_up = torch.randn(3, 2 * 17) * 4
    swapped = torch.cat((gate_up[:, 17:], gate_up[:, :17]), dim=1)
    with pytest.raises(AssertionError, match="max error"):
        assert_float32_close(ep.silu_mul(swapped, 17), silu_mul_ref(gate_up, 17))


def test_kernels_reject_what_they_cannot_read(ep) -> None:
    w = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        ep.add_rms_norm(torch.ones(2, 8, dtype=torch.float64), None, w, EPS)
    with pytest.raises(RuntimeError, match="contiguous"):
        ep.add_rms_norm(torch.ones(8, 2).t(), None, w, EPS)
    with pytest.raises(RuntimeError, match="delta must have"):
        ep.add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), w, EPS)
    with pytest.raises(RuntimeError, match="weight"):
        ep.add_rms_norm(torch.ones(2, 8), None, torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match=r"2 \* n"):
        ep.silu_mul(torch.ones(2, 8), 3)


@pytest.mark.parametrize(
    "arch, overrides", [("llama", {"tie_word_embeddings": True}), ("qwen3", {})]
)
def test_engine_fused_epilogue_matches_torch_path_and_hf(ep, checkpoint_dir, arch, overrides):
    """Greedy answers with the fused kernels equal those with torch's norms and silu, and
    transformers', under continuous batching and chunked prefill; the residual stream updated in
    place never writes into the weights (the tied case embeds from the packed LM head)."""
    model = checkpoint_dir(arch, **overrides)
    prompts = random_prompts([1, 15, 17, 53, 70], vocab=256, seed=5)
    out = {}
    for fused in (True, False):
        llm = LLM(str(model), kv_pool_tokens=2048, chunked_prefill_size=24)
        cm = llm.engine.runner.model
        assert llm.engine.runner.fused_epilogue and cm.epilogue is not None
        if not fused:
            cm.epilogue = None
        weights = [*cm.state_dict().values(), cm.head.panels]  # the packed head embeds
        before = [t.clone() for t in weights]
        out[fused] = run_staggered(llm.engine, prompts, GREEDY)
        after = [*cm.state_dict().values(), cm.head.panels]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert out[True] == out[False]
    assert out[True] == hf_greedy(model, prompts, GREEDY.max_tokens)


def test_fused_epilogue_for_float32_and_bfloat16_unless_linear_backend_torch(checkpoint_dir):
    model = str(checkpoint_dir("llama"))
    for kw, on in (({"dtype": "bfloat16"}, True), ({"linear_backend": "torch"}, False)):
        llm = LLM(model, kv_pool_tokens=256, context_length=64, **kw)
        assert llm.engine.runner.fused_epilogue is on, kw
        assert (llm.engine.runner.model.epilogue is not None) is on, kw
