"""Opt-in (RUN_SLOW=1): the MoE families' other config branches and a crowded pool, token-exact
with transformers. CI runs tests/test_moe.py (each family's routing features switched on);
these add the variants' other sides (no groups, several shared experts, every layer sparse,
un-normalised top-k, sparse every other layer, top-1, no sliding window, tied embeddings) and 32
concurrent requests over 1P1D (5 min on 2 cores at load average ~20; less alone):
`RUN_SLOW=1 .venv/bin/python -m pytest tests/test_moe_slow.py`."""

from __future__ import annotations

import os

import pytest
from conftest import hf_greedy, random_prompts
from pd_harness import PDPair, finished_ok
from test_engine_equivalence import run_staggered

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams

pytestmark = pytest.mark.skipif(
    os.environ.get("RUN_SLOW") != "1", reason="slow (MoE variants): set RUN_SLOW=1 to run"
)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
VARIANTS = [
    ("glm4_moe", dict(n_group=1, topk_group=1, use_qk_norm=False, attention_bias=False,
                      n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0)),
    ("glm4_moe", dict(norm_topk_prob=False, tie_word_embeddings=True)),
    ("qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])),
    ("mixtral", dict(num_experts_per_tok=1, sliding_window=None)),
]  # fmt: skip


@pytest.mark.parametrize("arch, overrides", VARIANTS, ids=lambda v: str(v))
def test_moe_variant_token_exact(arch, overrides, checkpoint_dir) -> None:
    model_dir = checkpoint_dir(arch, **overrides)
    prompts = random_prompts([1, 16, 17, 40, 90], vocab=256, seed=41)
    for backend in ("auto", "torch"):
        llm = LLM(str(model_dir), kv_pool_tokens=10 * 16, context_length=112,
                  chunked_prefill_size=20, linear_backend=backend)
        got = run_staggered(llm.engine, prompts, GREEDY)
        assert got == hf_greedy(model_dir, prompts, 16), f"{arch} {overrides} {backend}"
        assert llm.engine.stats().pages_used == 0


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "glm4_moe"])
def test_moe_1p1d_crowded_decode_pool_token_exact(arch, checkpoint_dir) -> None:
    model_dir = str(checkpoint_dir(arch))
    prompts = random_prompts([(13 * i) % 80 + 1 for i in range(32)], vocab=256, seed=43)
    want = [c.token_ids for c in LLM(model_dir, kv_pool_tokens=8192).generate(prompts, GREEDY)]
    pair = PDPair(model_dir, kv_pool_tokens=640, context_length=128, chunked_prefill_size=48)
    try:
        got = pair.generate(prompts, GREEDY)
        assert all(finished_ok(r) for r in got)
        assert [r.token_ids for r in got] == want
        assert pair.wait_idle()
    finally:
        pair.close()
