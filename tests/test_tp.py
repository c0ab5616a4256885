"""Tensor parallelism (--tp-size 2 on gloo, two processes of one thread): greedy answers are
token-exact with --tp-size 1 and with transformers under continuous batching and preemption; the
per-batch I2 check is combined across ranks, so a rank that skips it cannot let a bad row run
(the twin lets rank 0's flags decide alone and the breach goes through); a rank killed mid-decode
fails the engine closed (errors, never a hang: bounded by the group's timeout); preflight counts
what a rank holds."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, random_prompts
from fastapi.testclient import TestClient
from test_engine_equivalence import run_staggered
from test_i2_ownership import check_foreign_page_fails_closed
from test_prompt_logprobs import check as check_prompt_logprobs
from test_prompt_logprobs import hf_prompt_logprobs
from test_prompt_logprobs import only_first as first_carrying
from test_prompt_logprobs import run as run_to_end
from waiting import wait_for

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.admission import Rejected
from kvfence.engine.engine import Engine
from kvfence.engine.llm import LLM
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults
from kvfence.kv.sizing import plan_pool
from kvfence.model.config import ModelConfig
from kvfence.model.loader import load_model
from kvfence.model.tp import shard_model
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.tp_layout import TpLayout, tp_problem

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# A pool of 8 pages of 16 for 8 prompts up to 50 tokens: the staggered batch must preempt.
TIGHT = dict(kv_pool_tokens=128, context_length=96, chunked_prefill_size=96)
LENGTHS = [(7 * i) % 60 + 1 for i in range(8)]
# Bounds for the waits below: generous for a loaded 2-core machine; the engine's own bound on a
# stalled rank is --tp-timeout.
WAIT_S = 120.0


@pytest.fixture(scope="module")
def llama_tp2(checkpoint_dir) -> Iterator[tuple[LLM, Faults]]:
    faults = Faults()
    llm = LLM(str(checkpoint_dir("llama")), faults, tp_size=2, threads=2, **TIGHT)  # type: ignore[arg-type]
    yield llm, faults
    llm.engine.shutdown()


def test_tp2_greedy_token_exact_with_tp1_and_transformers_under_preemption(
    llama_tp2, checkpoint_dir
) -> None:
    llm, _ = llama_tp2
    model_dir = checkpoint_dir("llama")
    prompts = random_prompts(LENGTHS, vocab=256, seed=11)
    before = llm.engine.scheduler.num_preemptions
    got = run_staggered(llm.engine, prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to run out"
    one = run_staggered(LLM(str(model_dir), **TIGHT).engine, prompts, GREEDY)  # type: ignore[arg-type]
    assert got == one
    assert got == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert llm.engine.pool.num_used == 0


def test_tp2_prefix_cache_hits_read_sealed_pages_on_every_rank(llama_tp2, checkpoint_dir) -> None:
    llm, _ = llama_tp2
    base = random_prompts([40], vocab=256, seed=9)[0]
    prompts = [base, [*base, 5, 6, 7], [*base[:20], 9, 9, 9]]
    hits = llm.engine.pool.prefix.stats().hits  # type: ignore[union-attr]
    got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert llm.engine.pool.prefix.stats().hits > hits  # type: ignore[union-attr]
    one = LLM(str(checkpoint_dir("llama")), **TIGHT)  # type: ignore[arg-type]
    assert got == [one.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_tp2_prompt_logprobs_equal_transformers(llama_tp2, checkpoint_dir) -> None:
    """Every rank makes the scored positions' logits calls (each a gather of the vocab slices);
    rank 0 scores them: the prompt logprobs are transformers'."""
    llm, _ = llama_tp2
    model_dir = checkpoint_dir("llama")
    prompts = random_prompts([3, 30, 50], vocab=256, seed=12)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    outs = run_to_end(llm.engine, prompts, params)
    refs = hf_prompt_logprobs(model_dir, prompts)
    for i, p in enumerate(prompts):
        check_prompt_logprobs(first_carrying(outs[f"r{i}"]), p, refs[i], 2)


def test_tp2_every_rank_holds_its_slice(llama_tp2) -> None:
    engine = llama_tp2[0].engine
    mc = engine.model_config
    attn = engine.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (mc.num_heads // 2, mc.num_kv_heads // 2)
    assert engine.pool.k.shape[2] == mc.num_kv_heads // 2
    assert torch.get_num_threads() == 1  # --threads 2 over 2 ranks


def test_i2_tp_one_rank_skipping_the_check_still_stops_the_batch(llama_tp2) -> None:
    llm, faults = llama_tp2
    with faults.injected("tp_rank_skips_tag_check"):  # rank 0's own flags are all clear
        check_foreign_page_fails_closed(llm)


def test_i2_tp_twin_when_rank_0_decides_alone_the_breach_goes_unnoticed(llama_tp2) -> None:
    llm, faults = llama_tp2
    with (
        faults.injected("tp_rank_skips_tag_check", "tp_leader_decides_alone"),
        pytest.raises(AssertionError),
    ):
        check_foreign_page_fails_closed(llm)
    assert llm.engine.pool.num_used == 0


def test_tp2_rank_killed_mid_decode_fails_the_engine_closed(checkpoint_dir) -> None:
    """qwen3 (q/k norm): token-exact with transformers first, then rank 1 dies while two
    requests decode: both end in an error, nothing later is admitted, /health and /live say
    the engine is dead."""
    model_dir = checkpoint_dir("qwen3")
    engine = Engine(
        EngineConfig(str(model_dir), kv_pool_tokens=512, context_length=128, tp_size=2, threads=2)
    )
    engine.start()
    try:
        outs: dict[str, list[RequestOutput]] = {}

        def sink(o: RequestOutput) -> None:
            outs.setdefault(o.request_id, []).append(o)

        def finished(rid: str) -> bool:
            return any(o.finished for o in outs.get(rid, []))

        prompts = random_prompts([9, 30], vocab=256, seed=5)
        for i, p in enumerate(prompts):
            engine.submit(GenerateRequest(f"exact{i}", "t", tuple(p), GREEDY), sink)
        wait_for(lambda: finished("exact0") and finished("exact1"), WAIT_S, "greedy answers")
        got = [[t for o in outs[f"exact{i}"] for t in o.new_token_ids] for i in range(2)]
        assert got == hf_greedy(model_dir, prompts, GREEDY.max_tokens)

        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        for rid in ("long0", "long1"):
            engine.submit(GenerateRequest(rid, "t", tuple(prompts[0]), long), sink)
        wait_for(lambda: len(outs.get("long1", [])) >= 2, WAIT_S, "both requests decoding")
        assert engine.tp is not None
        os.kill(engine.tp.procs[0].pid, signal.SIGKILL)
        wait_for(lambda: finished("long0") and finished("long1"), WAIT_S, "errors after the kill")
        for rid in ("long0", "long1"):
            last = outs[rid][-1]
            assert last.finish_reason is FinishReason.ERROR and last.error_code == "engine_failed"
            assert sum(len(o.new_token_ids) for o in outs[rid]) < long.max_tokens
        wait_for(lambda: not engine.alive, WAIT_S, "the engine reports itself dead")
        late = engine.submit(GenerateRequest("late", "t", (1, 2, 3), GREEDY), sink)
        assert isinstance(late, Rejected) and (late.status, late.code) == (503, "engine_failed")
        client = TestClient(build_app(UnifiedService(engine), api_keys=None))
        assert client.get("/health").status_code == 503
        assert client.get("/live").status_code == 503
    finally:
        engine.shutdown()


def test_preflight_counts_what_a_rank_holds(checkpoint_dir, tmp_path: Path) -> None:
    # One KV head for two ranks (replicated) and a vocab of 255 (padded to 2 x 128 rows).
    model_dir = checkpoint_dir("llama", num_key_value_heads=1, vocab=255)
    mc = ModelConfig.from_dir(model_dir)
    plan = plan_pool(mc, dtype="float32", tp_size=2, model_dir=model_dir, device_memory_bytes=2**30)
    for rank in range(2):
        model = load_model(model_dir, "float32", "cpu")
        shard_model(model, TpLayout.of(mc, rank, 2))
        params = {id(p): p for p in model.parameters()}.values()
        held = sum(p.numel() * 4 for p in params)
        norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
        # The plan counts norms split (a few KiB); everything else is exactly what a rank holds.
        assert held - norms // 2 == plan.model_bytes
        assert model.model.layers[0].self_attn.k_proj.weight.shape[0] == mc.head_dim


def test_tp_refuses_what_it_cannot_split() -> None:
    mc = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        }
    )
    assert tp_problem(mc, 2, 128, moe=False) is None
    assert "num_attention_heads" in str(tp_problem(mc, 3, 128, moe=False))
    assert "mixture-of-experts" in str(tp_problem(mc, 2, 128, moe=True))
    with pytest.raises(ConfigError, match="--tp-size"):
        EngineConfig("m", tp_size=0)


@pytest.mark.skipif(
    os.environ.get("RUN_SLOW") != "1", reason="opt-in (RUN_SLOW=1): waits out --tp-timeout"
)
def test_tp2_stalled_rank_fails_the_engine_closed_within_the_timeout(checkpoint_dir) -> None:
    """Rank 1 stopped (SIGSTOP), not dead: the next collective times out after --tp-timeout and
    the engine fails closed just as for a dead rank. Run:
    `RUN_SLOW=1 .venv/bin/python -m pytest tests/test_tp.py -k stalled`."""
    cfg = EngineConfig(
        str(checkpoint_dir("llama")),
        kv_pool_tokens=512,
        context_length=128,
        tp_size=2,
        threads=2,
        tp_timeout=5.0,
    )
    engine = Engine(cfg)
    engine.start()
    assert engine.tp is not None
    pid = engine.tp.procs[0].pid
    try:
        outs: list[RequestOutput] = []
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        engine.submit(GenerateRequest("s", "t", (5, 6, 7), long), outs.append)
        wait_for(lambda: len(outs) >= 2, WAIT_S, "decoding")
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: outs[-1].finished, WAIT_S, "an error after the stall")
        assert outs[-1].finish_reason is FinishReason.ERROR
        assert outs[-1].error_code == "engine_failed"
        assert not engine.alive
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.shutdown()


def test_pd_roles_refuse_tensor_parallelism_over_mooncake_at_start_up(tmp_path: Path) -> None:
    """One-sided writes reach only rank 0's slice: refused before any certificate is read or
    rank started (tcp PD with --tp-size 2 runs: tests/test_pd_tp.py)."""
    from kvfence.cli import build_parser
    from kvfence.config import NodeConfig
    from kvfence.node import build_role

    for mode in ("prefill", "decode"):
        argv = ["serve", "--model", str(tmp_path), "--disaggregation-mode", mode, "--tp-size", "2",
                "--disaggregation-transfer-backend", "mooncake"]  # fmt: skip
        with pytest.raises(ConfigError, match="mooncake with --tp-size 2"):
            build_role(NodeConfig.from_args(build_parser().parse_args(argv)), Faults())


def test_up_refuses_tensor_parallelism_over_mooncake_before_starting_anything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfence.tools.up import main as up_main

    tiny = Path(__file__).resolve().parent.parent / "models" / "kvfence-tiny"
    argv = ["--model", str(tiny), "--tp-size", "2", "--disaggregation-transfer-backend", "mooncake"]
    assert up_main(argv) == 2
    assert "tensor-parallel PD workers use the tcp backend" in capsys.readouterr().err


def test_i7_pairing_compares_the_tp_split() -> None:
    from kvfence.pd.pairing import pairing_problem

    base = dict(
        transfer_backend="tcp", model_fingerprint="f", page_size=16, kv_dtype="float32",
        kv_layout=[2, 2, 16, "page-blocks"], context_length=64, pool_tokens=128,
    )  # fmt: skip
    one = {**base, "role": "prefill", "tp_layout": [1, 2]}
    assert pairing_problem(one, {**one, "role": "decode"}) is None
    two = {**base, "role": "decode", "tp_layout": [2, 1]}
    assert "tp_layout differs" in str(pairing_problem(one, two))
