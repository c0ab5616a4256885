"""Tests for KV pool sizing and `kvfence preflight` (incident fault 1: pool < context length)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvfence.config import EngineConfig
from kvfence.kv.sizing import (
    CapacityError,
    activation_reserve_bytes,
    checkpoint_weight_bytes,
    device_memory_bytes,
    dtype_bytes,
    kv_bytes_per_token,
    plan_for_engine,
    plan_pool,
    require_fits,
)
from kvfence.model.config import ModelConfig
from kvfence.tools.preflight import main

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

LLAMA3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def write_model(path: Path, cfg: dict[str, Any], **overrides: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**cfg, **overrides}))
    return path


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "tiny", TINY)


def tiny_mc(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, **overrides})


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


# --- the formula ------------------------------------------------------------------------------


def test_dtype_bytes() -> None:
    assert dtype_bytes("float32") == 4
    assert dtype_bytes("bfloat16") == dtype_bytes("float16") == dtype_bytes("torch.bfloat16") == 2
    assert dtype_bytes("fp8_e4m3") == dtype_bytes("fp8_e5m2") == 1
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_bytes("int3")


def test_kv_bytes_per_token_matches_hand_computation() -> None:
    mc = tiny_mc()
    # 2 (K, V) * 4 layers * 2 kv heads * 16 head_dim * 4 bytes
    assert kv_bytes_per_token(mc, "float32") == 2 * 4 * 2 * 16 * 4 == 1024
    assert kv_bytes_per_token(mc, "bfloat16") == 512
    assert kv_bytes_per_token(mc, "fp8_e4m3") == 256
    assert kv_bytes_per_token(mc, "float32", tp_size=2) == 512


def test_kv_heads_replicate_when_tp_exceeds_kv_heads() -> None:
    mc = tiny_mc()  # 2 kv heads: from tp 2 on every rank holds exactly one
    per_rank = [kv_bytes_per_token(mc, "float32", tp_size=tp) for tp in (1, 2, 4, 8)]
    assert per_rank == [1024, 512, 512, 512]


def test_memory_pool_matches_hand_computation_and_whole_pages() -> None:
    mc = tiny_mc()
    mem = 10 * 2**20
    plan = plan_pool(
        mc,
        dtype="float32",
        page_size=16,
        mem_fraction_static=0.5,
        device_memory_bytes=mem,
        chunked_prefill_size=512,
        max_running_requests=64,
    )
    reserve = 512 * (4 * 64 + 3 * 128) * 4 + 64 * 256 * 4
    assert plan.activation_reserve_bytes == reserve
    assert plan.model_bytes == mc.num_params * 4
    budget = mem // 2 - mc.num_params * 4 - reserve
    raw_tokens = budget // 1024
    assert raw_tokens % 16, "choose sizes whose raw token count is not page-aligned"
    assert plan.pool_tokens == raw_tokens // 16 * 16
    assert plan.pool_pages * plan.page_size == plan.pool_tokens
    assert plan.context_length == 1024
    assert plan.max_full_context_requests == plan.pool_tokens // 1024
    assert plan.pool_source == "memory"


def test_explicit_pool_rounds_down_to_pages_and_wins_over_memory() -> None:
    plan = plan_pool(tiny_mc(), dtype="float32", kv_pool_tokens=1000, device_memory_bytes=64 * GIB)
    assert (plan.pool_tokens, plan.pool_pages) == (992, 62)  # 1000 // 16 pages
    assert plan.pool_source == "kv_pool_tokens"
    assert plan.memory_pool_tokens > 992


def test_pool_of_exactly_one_context_fits_one_page_less_does_not() -> None:
    common: dict[str, Any] = dict(dtype="float32", context_length=512, device_memory_bytes=GIB)
    assert plan_pool(tiny_mc(), kv_pool_tokens=512, **common).fits
    # 527 tokens would hold 512, but rounding to 16-token pages is what the allocator can give.
    assert not plan_pool(tiny_mc(), kv_pool_tokens=511, **common).fits
    assert plan_pool(tiny_mc(), kv_pool_tokens=527, **common).pool_tokens == 512


def weight_bytes(
    mc: ModelConfig, dtype: str, tp_size: int = 1, model_dir: Path | None = None
) -> int:
    """Weight bytes per rank, as the plan counts them."""
    plan = plan_pool(mc, dtype=dtype, tp_size=tp_size, model_dir=model_dir, device_memory_bytes=GIB)
    return plan.model_bytes


def test_weight_bytes_from_safetensors_headers(tmp_path: Path) -> None:
    d = write_model(tmp_path / "m", TINY)
    save_file(
        {"a": np.zeros((10, 20), np.float32), "b": np.zeros(7, np.float32)}, d / "x.safetensors"
    )
    save_file({"c": np.zeros((3, 3), np.float16), "i": np.zeros(5, np.int64)}, d / "y.safetensors")
    floats = 10 * 20 + 7 + 9
    assert checkpoint_weight_bytes(d, "float32") == floats * 4 + 5 * 8
    assert checkpoint_weight_bytes(d, "bfloat16") == floats * 2 + 5 * 8
    assert weight_bytes(tiny_mc(), "bfloat16", tp_size=2, model_dir=d) == (floats * 2 + 40) // 2
    # Mistral ships consolidated.safetensors next to the HF shards: counting both doubles weights.
    save_file({"a": np.zeros((10, 20), np.float32)}, d / "consolidated.safetensors")
    assert checkpoint_weight_bytes(d, "float32") == floats * 4 + 5 * 8
    plan = plan_pool(tiny_mc(), dtype="float32", device_memory_bytes=GIB, model_dir=d)
    assert plan.weights_source == "safetensors"


def test_weight_bytes_falls_back_to_num_params(tiny_dir: Path) -> None:
    mc = tiny_mc()
    assert checkpoint_weight_bytes(tiny_dir, "float32") is None
    assert weight_bytes(mc, "bfloat16", model_dir=tiny_dir) == mc.num_params * 2


def test_cpu_device_memory_is_memtotal() -> None:
    memtotal = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    assert device_memory_bytes("cpu") == memtotal


def test_require_fits_raises_with_plan() -> None:
    small = plan_pool(tiny_mc(), dtype="float32", kv_pool_tokens=256, device_memory_bytes=GIB)
    with pytest.raises(CapacityError) as e:
        require_fits(small)
    assert e.value.plan is small
    assert "256" in str(e.value) and "1024" in str(e.value)


def test_require_fits_passes_a_fitting_plan() -> None:
    ok = plan_pool(tiny_mc(), dtype="float32", kv_pool_tokens=2048, device_memory_bytes=GIB)
    assert require_fits(ok) is ok


def test_plan_for_engine_uses_engine_config(tiny_dir: Path) -> None:
    cfg = EngineConfig(model=str(tiny_dir), kv_pool_tokens=4000, context_length=512)
    plan = plan_for_engine(cfg, tiny_mc(), device_memory=GIB, role="decode")
    assert (plan.pool_tokens, plan.context_length, plan.role) == (4000, 512, "decode")
    assert plan.fits and plan.max_full_context_requests == 7


def test_incident_pool_is_too_small() -> None:
    # The incident: a 681,280-token prefill pool behind a 1,048,576-token context.
    plan = plan_pool(
        tiny_mc(),
        dtype="bfloat16",
        kv_pool_tokens=681_280,
        context_length=1_048_576,
        device_memory_bytes=GIB,
        role="prefill",
    )
    assert not plan.fits and plan.max_full_context_requests == 0
    msg = plan.problem()
    assert msg is not None and "681280" in msg and "1048576" in msg


def test_incident_fixed_pool_fits() -> None:
    # The containment: about 2.04M tokens, twice the context length.
    plan = plan_pool(
        tiny_mc(),
        dtype="bfloat16",
        kv_pool_tokens=2_097_152,
        context_length=1_048_576,
        device_memory_bytes=GIB,
        role="prefill",
    )
    assert plan.fits and plan.max_full_context_requests == 2 and plan.problem() is None


# --- the CLI ----------------------------------------------------------------------------------


def test_cli_explicit_pool_below_context_exits_2_naming_both_numbers(
    tiny_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["--model", str(tiny_dir), "--kv-pool-tokens", "800", "--context-length", "1000"])
    out = capsys.readouterr().out
    assert code == 2
    assert "TOO SMALL" in out
    error = next(line for line in out.splitlines() if line.startswith("error:"))
    assert "800" in error and "1000" in error
    assert "--kv-pool-tokens" in error and "--mem-fraction-static" in error


def test_cli_fitting_pool_exits_0(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--model", str(tiny_dir), "--kv-pool-tokens", "4096", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0
    assert "verdict" in out and "OK" in out and "error:" not in out
    assert "256 pages x 16" in out


def test_cli_json_parses(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, d = run_json(
        capsys,
        [
            "--model",
            str(tiny_dir),
            "--kv-pool-tokens",
            "1000",
            "--role",
            "decode",
            "--page-size",
            "32",
            "--context-length",
            "512",
        ],
    )
    assert code == 0 and d["exit_code"] == 0
    assert d["role"] == "decode" and d["verdict"] == "OK" and d["problem"] is None
    assert (d["pool_tokens"], d["pool_pages"], d["page_size"]) == (992, 31, 32)
    assert d["kv_bytes_per_token"] == 1024 and d["context_length"] == 512
    assert d["max_full_context_requests"] == 1


def test_cli_roles_share_one_formula(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = {}
    for role in ("unified", "prefill", "decode"):
        _, d = run_json(
            capsys, ["--model", str(tiny_dir), "--device-memory-gib", "1", "--role", role]
        )
        plans[role] = {k: v for k, v in d.items() if k != "role"}
    assert plans["unified"] == plans["prefill"] == plans["decode"]


def test_cli_config_only_70b_on_8x80gib(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d70 = write_model(tmp_path / "llama3-70b", LLAMA3_70B)
    argv = ["--model", str(d70), "--device-memory-gib", "80", "--tp-size", "8"]
    code, d = run_json(capsys, argv)
    mc = ModelConfig.from_dict(LLAMA3_70B)
    assert code == 0
    assert d["dtype"] == "bfloat16" and d["weights_source"] == "config"
    assert 70e9 < mc.num_params < 71e9
    assert d["model_bytes"] == math.ceil(mc.num_params * 2 / 8)
    assert d["kv_bytes_per_token"] == 2 * 80 * 1 * 128 * 2  # one of 8 kv heads per rank
    reserve = activation_reserve_bytes(mc, "bfloat16", 8)
    expected = (40 * GIB - d["model_bytes"] - reserve) // 40960 // 16 * 16
    assert d["pool_tokens"] == expected
    assert d["max_full_context_requests"] == expected // 8192 > 1
    # The same hardware behind a 1M context is the incident's shape.
    code, d = run_json(capsys, [*argv, "--context-length", "1048576"])
    assert code == 2 and str(expected) in d["problem"] and "1048576" in d["problem"]


def test_cli_weights_larger_than_device_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d70 = write_model(tmp_path / "llama3-70b", LLAMA3_70B)
    code, d = run_json(capsys, ["--model", str(d70), "--device-memory-gib", "80"])
    assert code == 2 and d["pool_tokens"] == 0
    assert "--tp-size" in d["problem"]


def test_cli_unsupported_architecture_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = write_model(tmp_path / "gpt2", TINY, architectures=["GPT2LMHeadModel"])
    assert main(["--model", str(d)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "GPT2LMHeadModel" in err and "not supported" in err


def test_cli_missing_dir_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "absent")]) == 1
    assert "not a directory" in capsys.readouterr().err


def test_cli_bad_flag_exits_1_not_2(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse's own exit code is 2, which a script would read as "pool too small".
    assert main(["--model", str(tiny_dir), "--role", "router"]) == 1
    assert main(["--model", str(tiny_dir), "--tp-size", "3"]) == 1
    assert "does not divide" in capsys.readouterr().err


def test_cli_reads_transformers_saved_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=512,
    )
    cfg.save_pretrained(tmp_path / "hf")
    code, d = run_json(capsys, ["--model", str(tmp_path / "hf"), "--kv-pool-tokens", "4096"])
    assert code == 0
    assert d["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * dtype_bytes(d["dtype"])


def test_module_entry_point_subprocess(tiny_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvfence.tools.preflight", "--model", str(tiny_dir),
         "--kv-pool-tokens", "100", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "TOO SMALL"
