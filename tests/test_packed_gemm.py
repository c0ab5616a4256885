"""The native packed float32 matmul (kvfence/model/kernels/packed_gemm.cpp) and the projections
that use it (kvfence/model/linear.py): same products as float64 matmuls to float32 rounding,
for every row count and ragged shapes, tied embeddings read from the packed head, and the engine
answers the same on both linear backends."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.model import kernels
from kvfence.model.linear import Projection, to_panels


@pytest.fixture(scope="module")
def gemm():
    g = kernels.packed_gemm()
    # CI installs g++ (.ci/run): a missing kernel there is a failure, not a skip.
    assert g is not None, "the packed gemm kernel did not build; see the warning in the log"
    return g


def close_to_float64(y: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor) -> None:
    ref = x.double() @ w_t.double()
    # float32 sums over K terms: error grows like sqrt(K) * eps * |x| |w|.
    tol = 8 * x.shape[1] ** 0.5 * 1.2e-7 * (x.abs().double() @ w_t.abs().double()).max()
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert (y.double() - ref).abs().max() <= tol


# m: one register tile (<= 8), several walking K in blocks (9..64), and groups of blocked tiles
# (> 64); k: one block of K (<= 128) or several, the last one ragged.
@pytest.mark.parametrize("m", [1, 2, 5, 7, 8, 9, 16, 17, 40, 64, 65, 130])
@pytest.mark.parametrize("k, n", [(64, 48), (37, 100), (96, 1), (128, 241), (300, 97)])
def test_packed_matmul_equals_float64(gemm, m, k, n) -> None:
    torch.manual_seed(m * 1000 + k + n)
    x, w_t = torch.randn(m, k), torch.randn(k, n)
    y = gemm.matmul(x, to_panels(w_t, gemm.width), n)
    close_to_float64(y, x, w_t)


def test_every_output_column_is_its_own_weight_column(gemm) -> None:
    """A one-hot weight column shows up in exactly its output column: panel order and the
    ragged last panel are right, and the padding never leaks into a real column."""
    k, n = 32, 100
    x = torch.arange(1.0, k + 1).repeat(3, 1)
    for col in (0, 47, 48, 95, 96, 99):
        w_t = torch.zeros(k, n)
        w_t[col % k, col] = 1.0
        y = gemm.matmul(x, to_panels(w_t, gemm.width), n)
        expect = torch.zeros(3, n)
        expect[:, col] = float(col % k + 1)
        assert torch.equal(y, expect)


def test_packed_matmul_rejects_mismatched_shapes(gemm) -> None:
    panels = to_panels(torch.randn(16, 60), gemm.width)
    with pytest.raises(RuntimeError, match="packed shape"):
        gemm.matmul(torch.randn(2, 15), panels, 60)
    with pytest.raises(RuntimeError, match="panel count"):
        gemm.matmul(torch.randn(2, 16), panels, 200)
    with pytest.raises(RuntimeError, match="float32"):
        gemm.matmul(torch.randn(2, 16, dtype=torch.float64), panels, 60)


def test_projection_packed_matches_plain_with_bias_and_rows(gemm) -> None:
    torch.manual_seed(0)
    w = torch.randn(130, 24)  # [out, in]
    bias = torch.randn(130)
    plain, packed = Projection(w.t().contiguous()), Projection(w.t().contiguous())
    packed.pack(gemm)
    assert packed.w_t is None and packed.panels is not None
    x = torch.randn(6, 24)
    close_to_float64(packed(x, bias) - bias, x, w.t())
    assert torch.allclose(packed(x, bias), plain(x, bias), atol=1e-5)
    ids = torch.tensor([0, 47, 48, 129, 5, 5])
    assert torch.equal(packed.rows(ids), w[ids])
    assert torch.equal(plain.rows(ids), w[ids])


@pytest.mark.parametrize("tied", [False, True])
def test_engine_linear_backends_agree_and_match_hf(gemm, checkpoint_dir, tied) -> None:
    """Greedy answers are the same with packed and torch matmuls and equal transformers' (the
    tied case reads the embedding from the packed LM head); packing releases the HF-named
    weights, so memory does not double."""
    model = checkpoint_dir("llama", tie_word_embeddings=tied)
    prompts = random_prompts([3, 17, 40, 70], vocab=256, seed=7)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = {}
    for backend in ("native", "torch"):
        llm = LLM(str(model), kv_pool_tokens=512, context_length=128, linear_backend=backend)
        runner = llm.engine.runner
        assert runner.packed_linear == (backend == "native")
        if backend == "native":
            cm = runner.model
            assert cm.lm_head.weight.numel() == 0
            assert cm.model.layers[0].mlp.down_proj.weight.numel() == 0
        out[backend] = [c.token_ids for c in llm.generate(prompts, params)]
    assert out["native"] == out["torch"]
    assert out["native"] == hf_greedy(model, prompts, 10)


def test_packed_backend_needs_cpu_and_float32_or_bf16_dot_products(checkpoint_dir) -> None:
    model = str(checkpoint_dir("llama"))
    auto = LLM(model, kv_pool_tokens=256, context_length=64, dtype="bfloat16")
    # bf16 packs where the host has bf16 dot products; elsewhere auto falls back to oneDNN
    assert auto.engine.runner.packed_linear is kernels.has_bf16_dot()
    assert auto.engine.runner.onednn_linear is not kernels.has_bf16_dot()
    if not kernels.has_bf16_dot():
        with pytest.raises(RuntimeError, match="--linear-backend native"):
            LLM(model, kv_pool_tokens=256, context_length=64, dtype="bfloat16",
                linear_backend="native")
    with pytest.raises(ConfigError, match="--linear-backend"):
        EngineConfig(model="m", linear_backend="blas")
    with pytest.raises(ConfigError, match="CPU-only"):
        EngineConfig(model="m", device="cuda", linear_backend="native")
