"""--context-length past what the checkpoint's positions support (max_position_embeddings, or
what its rope scaling extends it to) is refused at start with a message naming the fix, unless
the operator passes --allow-context-beyond-positions."""

from __future__ import annotations

import pytest

from kvfence.cli import build_parser
from kvfence.config import ConfigError
from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.model.config import ModelConfig

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_context_beyond_max_position_embeddings_is_refused_at_start(checkpoint_dir) -> None:
    model = str(checkpoint_dir("llama"))  # max_position_embeddings 512
    with pytest.raises(ConfigError, match="--context-length 1024 exceeds the 512 positions") as e:
        LLM(model, kv_pool_tokens=2048, context_length=1024)
    assert "--allow-context-beyond-positions" in str(e.value)
    LLM(model, kv_pool_tokens=2048, context_length=512)  # exactly the positions: starts


def test_the_override_starts_and_serves(checkpoint_dir, caplog) -> None:
    model = str(checkpoint_dir("llama"))
    llm = LLM(model, kv_pool_tokens=2048, context_length=1024, allow_context_beyond_positions=True)
    assert llm.engine.context_length == 1024
    assert "--allow-context-beyond-positions" in caplog.text
    [out] = llm.generate([[1, 2, 3]], GREEDY)
    assert len(out.token_ids) == 4


def test_rope_scaling_extends_the_limit(checkpoint_dir) -> None:
    linear = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    mc = ModelConfig.from_dir(checkpoint_dir("llama", **linear))
    assert mc.max_supported_positions == 2048 and mc.context_problem(2048) is None
    assert mc.context_problem(2049) is not None
    # llama3 scaling's max_position_embeddings is already the extended length.
    llama3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
    assert ModelConfig.from_dir(checkpoint_dir("llama", **llama3)).max_supported_positions == 512


def test_flag_parses_into_the_engine_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--context-length", "4096", "--allow-context-beyond-positions"]
    )
    assert args.allow_context_beyond_positions is True
    plain = build_parser().parse_args(["serve", "--model", "m"])
    assert plain.allow_context_beyond_positions is False
