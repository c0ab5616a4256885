"""Mixture-of-experts models (Mixtral, Qwen3-MoE, GLM-4 MoE) are greedy token-exact with
transformers in one unified engine under staggered continuous batching, chunked prefill,
preemption and prefix-cache hits, and over 1P1D (real TCP); the expert block matches
transformers' block in float32 and bfloat16 on both linear paths."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts
from pd_harness import PDPair, finished_ok
from test_engine_equivalence import run_staggered

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.model.loader import load_model
from kvfence.model.moe import SparseMoE

FAMILIES = ["mixtral", "qwen3_moe", "glm4_moe"]
PAGE = 16
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def prompts_with_shared_prefix() -> list[list[int]]:
    """Lengths around page edges, one past the Mixtral window (48), and a late prompt that
    repeats an early one's first 48 tokens so the prefix cache hits."""
    a, b, c, d = random_prompts([1, 17, 70, 33], vocab=256, seed=11)
    return [a, c, b, d, c[:48] + d[:9]]


PROMPTS = prompts_with_shared_prefix()


@pytest.fixture(scope="module")
def reference(checkpoint_dir):
    """transformers' greedy answers to PROMPTS, once per family."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_greedy(checkpoint_dir(arch), PROMPTS, MAX_NEW)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", FAMILIES)
def test_moe_unified_token_exact_batching_chunking_preemption_prefix(
    arch, checkpoint_dir, reference
) -> None:
    model_dir = checkpoint_dir(arch)
    prompts = PROMPTS
    # 12 pages: two of the long prompts cannot run together, so someone is preempted. No step-time
    # target (it reads the clock): the chunks, so who runs together, are the same on every machine.
    llm = LLM(str(model_dir), kv_pool_tokens=12 * PAGE, page_size=PAGE, context_length=96,
              chunked_prefill_size=24, max_decode_step_ms=0)
    assert llm.engine.runner.attention.name == "cpu_native"  # chunks read pages in place
    got = run_staggered(llm.engine, prompts, GREEDY)
    want = reference(arch)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"{arch}: prompt {i} ({len(prompts[i])} tokens) diverged"
    stats = llm.engine.stats()
    assert stats.preemptions > 0, "the pool was meant to run out"
    assert stats.prefix_cache is not None and stats.prefix_cache.hits > 0
    assert stats.pages_used == 0


def test_moe_torch_linear_path_token_exact(checkpoint_dir, reference) -> None:
    """The path CUDA takes (torch matmuls over the stacked expert weights), on GLM-4 MoE."""
    llm = LLM(str(checkpoint_dir("glm4_moe")), kv_pool_tokens=1024, linear_backend="torch",
              chunked_prefill_size=16)
    assert not llm.engine.runner.packed_linear
    got = [c.token_ids for c in llm.generate(PROMPTS[:2], GREEDY)]
    assert got == reference("glm4_moe")[:2]


def test_moe_bfloat16_engine_agrees_on_the_first_token(checkpoint_dir, reference) -> None:
    """bfloat16 weights and KV through the whole engine (router kept in float32 for GLM): greedy
    continuations drift from float32's, the first token of each prompt does not here."""
    llm = LLM(str(checkpoint_dir("glm4_moe")), dtype="bfloat16", kv_pool_tokens=1024)
    assert llm.engine.model.model.layers[1].ffn.gate.weight.dtype == torch.float32
    got = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
    assert all(len(g) == MAX_NEW for g in got)
    assert [g[0] for g in got] == [w[0] for w in reference("glm4_moe")]
    assert llm.engine.stats().pages_used == 0


@pytest.mark.parametrize("arch", FAMILIES)
def test_moe_1p1d_tcp_token_exact(arch, checkpoint_dir, reference) -> None:
    pair = PDPair(str(checkpoint_dir(arch)), kv_pool_tokens=512, context_length=128,
                  chunked_prefill_size=32)
    try:
        got = pair.generate(PROMPTS, GREEDY)
        assert all(finished_ok(r) for r in got)
        assert [r.token_ids for r in got] == reference(arch)
        assert pair.wait_idle()
        assert pair.decode.transfer_stats.get("transfers_committed") == len(PROMPTS)
    finally:
        pair.close()


def hf_block(model_dir, layer: int, dtype: torch.dtype) -> torch.nn.Module:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    blk = model.model.layers[layer]
    return blk.block_sparse_moe if hasattr(blk, "block_sparse_moe") else blk.mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_moe_block_matches_transformers(arch, dtype, checkpoint_dir) -> None:
    """Many tokens at once (every expert active), fused and unfused weights."""
    model_dir = checkpoint_dir(arch)
    ours = load_model(model_dir, "float32" if dtype == torch.float32 else "bfloat16", "cpu")
    layer = max(ours.config.moe.sparse_layers)
    block = ours.model.layers[layer].ffn
    assert isinstance(block, SparseMoE)
    x = torch.randn(64, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    x = x.to(dtype)
    with torch.inference_mode():
        want = hf_block(model_dir, layer, dtype)(x.unsqueeze(0)).squeeze(0)
        unfused = block(x)
        block.fuse()
        fused = block(x)
    for got in (unfused, fused):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # bfloat16 rounding differs by matmul; routing itself is the same
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < 1e-2, f"{arch} bf16 relative error {err:.4f}"
