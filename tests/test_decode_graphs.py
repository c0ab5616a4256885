"""Decode per batch-size bucket (kvfence/engine/decode_graphs.py), CUDA's captured path, run
uncaptured on CPU through the same buffers and padding: greedy answers token-exact with eager
decode while rows finish mid-batch and the batch moves between buckets (and past the largest,
to eager), and the padding rows leave the null page zeroed."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.decode_graphs import buckets
from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams


def test_buckets_pad_to_powers_of_two_then_multiples_of_16() -> None:
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert buckets(128)[-3:] == [96, 112, 128]


@pytest.mark.parametrize("arch,backend", [("llama", "flex"), ("llama", "auto"),
                                          ("qwen3_moe", "flex")])
def test_bucketed_decode_is_token_exact_with_eager(checkpoint_dir, arch, backend) -> None:
    model = str(checkpoint_dir(arch))
    prompts = random_prompts([3, 17, 30, 9, 22, 5], vocab=256, seed=7)
    # Different lengths: rows finish mid-batch, 6 -> 5 -> ... -> 1 rows, so the batch runs
    # eagerly (over the largest bucket, 4), then in buckets 4, 2 (padded from 3) and 1.
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (3, 12, 7, 14, 5, 9)]
    out = {}
    for mode in ("on", "off"):
        llm = LLM(model, kv_pool_tokens=512, context_length=128, attention_backend=backend,
                  cuda_graph=mode, cuda_graph_max_bs=4)
        out[mode] = [c.token_ids for c in llm.generate(prompts, params)]
        graphs = llm.engine.runner.graphs
        if mode == "on":
            assert graphs is not None
            assert {4, 2, 1} <= set(graphs.steps_by_bucket), graphs.steps_by_bucket
            ps = llm.engine.pool.page_size
            assert not llm.engine.pool.k[:, :ps].any() and not llm.engine.pool.v[:, :ps].any()
        else:
            assert graphs is None
    assert out["on"] == out["off"]


def test_cuda_graph_flags_are_validated() -> None:
    with pytest.raises(ConfigError, match="--cuda-graph"):
        EngineConfig(model="m", cuda_graph="always")
    with pytest.raises(ConfigError, match="--cuda-graph-max-bs"):
        EngineConfig(model="m", cuda_graph_max_bs=0)
    assert torch.device(EngineConfig(model="m").device).type == "cpu"
