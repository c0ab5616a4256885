"""bfloat16 end to end (weights, KV pool, the native attention kernels reading bf16 pages,
oneDNN's bf16 matmuls, the native bf16 epilogue kernels, PD transfer checksums over bf16 pages):
greedy answers agree at top-1 with transformers' bf16 model fed the same tokens
(teacher-forced), unified and 1P1D over tcp."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from pd_harness import PDPair, finished_ok

from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.model import kernels

N_PROMPTS, MAX_NEW = 32, 64
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
# The bar, on real checkpoints: >= 99% of steps. A tiny random model's logits sit near
# 1.5, where bf16's step is 1/128, so transformers itself ties often; every step that differs
# must then be such a tie (its token within two bf16 steps of transformers' top logit), and at
# most 2% of steps may differ at all.
MIN_AGREEMENT = 0.98
MAX_GAP_ULPS = 2.0


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    lengths = [1 + (i * 37) % 90 for i in range(N_PROMPTS)]  # 1..90 tokens, chunks of 32
    return random_prompts(lengths, vocab=256, seed=21)


def agreement(model_dir, prompts: list[list[int]], answers: list[list[int]]) -> tuple[float, float]:
    """The share of answer tokens that are transformers' bf16 argmax given every token before
    them (the prompt and the answer so far), and the widest gap, in bf16 steps of the top logit,
    between transformers' top logit and the answer's where they differ."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    same = total = 0
    worst = 0.0
    with torch.inference_mode():
        for p, a in zip(prompts, answers, strict=True):
            assert len(a) == MAX_NEW
            logits = model(torch.tensor([p + a[:-1]])).logits[0, len(p) - 1 :].float()
            want = torch.tensor(a)
            top = logits.max(-1).values
            gap = top - logits.gather(1, want[:, None])[:, 0]
            ulp = torch.exp2(torch.floor(torch.log2(top.abs())) - 7)  # bf16: 8 significant bits
            same += int((logits.argmax(-1) == want).sum())
            worst = max(worst, float((gap / ulp).max()))
            total += len(a)
    return same / total, worst


def check(share: float, worst: float, what: str) -> None:
    assert share >= MIN_AGREEMENT, f"{what}: top-1 agreement {share:.4f}"
    assert worst <= MAX_GAP_ULPS, f"{what}: a step {worst:.1f} bf16 steps below the top logit"


@pytest.mark.parametrize("arch, tied", [("llama", False), ("llama", True), ("qwen3", False)])
def test_bf16_unified_top1_agrees_with_transformers(arch, tied, checkpoint_dir, prompts) -> None:
    model_dir = checkpoint_dir(arch, **({"tie_word_embeddings": True} if tied else {}))
    llm = LLM(str(model_dir), dtype="bfloat16", kv_pool_tokens=8192, context_length=256,
              chunked_prefill_size=32)
    assert llm.engine.pool.k.dtype == torch.bfloat16
    assert llm.engine.runner.attention.name == "cpu_native"  # bf16 pages read in place
    # The native bf16 norms and silu * up, and rope + cache write where there is no q/k norm.
    assert llm.engine.runner.fused_epilogue
    assert (llm.engine.runner.model.rope_store is not None) is (arch == "llama")
    answers = [c.token_ids for c in llm.generate(prompts, GREEDY)]
    check(*agreement(model_dir, prompts, answers), arch)


def test_bf16_1p1d_top1_agrees_with_transformers(checkpoint_dir, prompts) -> None:
    model_dir = checkpoint_dir("llama")
    pair = PDPair(str(model_dir), dtype="bfloat16", kv_pool_tokens=8192, context_length=256,
                  chunked_prefill_size=32)
    try:
        got = pair.generate(prompts, GREEDY)
        assert all(finished_ok(r) for r in got)
        assert pair.wait_idle()
        # Every transfer's pages were checked against the sender's checksums (I3).
        assert pair.decode.transfer_stats.get("transfers_committed") == len(prompts)
    finally:
        pair.close()
    check(*agreement(model_dir, prompts, [r.token_ids for r in got]), "1P1D")


def test_bf16_tied_tp2_top1_agrees_with_transformers(checkpoint_dir, prompts) -> None:
    """--tp-size 2 with a tied bf16 head: each rank's embedding rows come from its slice of the
    head (ParallelPackedHead.rows) in the head's dtype, summed across ranks."""
    model_dir = checkpoint_dir("llama", tie_word_embeddings=True)
    llm = LLM(str(model_dir), dtype="bfloat16", kv_pool_tokens=4096, context_length=256,
              chunked_prefill_size=32, tp_size=2, threads=2)
    try:
        answers = [c.token_ids for c in llm.generate(prompts[:8], GREEDY)]
    finally:
        llm.engine.shutdown()
    check(*agreement(model_dir, prompts[:8], answers), "tied, tp 2")


def test_bf16_tied_head_has_one_copy_or_a_counted_second(checkpoint_dir) -> None:
    """A tied bf16 head on the packed kernel (a host with bf16 dot products) is the embedding's
    only copy: lookups read rows from its panels, as float32's do. Without bf16 dot products it
    is reordered for oneDNN into a copy of its own and the embedding keeps its plain rows. Either
    way the logits are the tied matrix's and lookups its rows."""
    import torch.nn.functional as F

    model_dir = checkpoint_dir("llama", tie_word_embeddings=True)
    plain = LLM(str(model_dir), dtype="bfloat16", kv_pool_tokens=256, context_length=64,
                linear_backend="torch").engine.runner.model.model.embed_tokens.weight
    llm = LLM(str(model_dir), dtype="bfloat16", kv_pool_tokens=256, context_length=64)
    cm = llm.engine.runner.model
    assert cm.head is not None
    packed = llm.engine.runner.packed_linear
    assert packed is kernels.has_bf16_dot()
    assert cm.embeds_from_head is packed
    if packed:
        assert cm.head.panels is not None and cm.model.embed_tokens.weight.numel() == 0
        table = cm.head.rows(torch.arange(cm.config.vocab_size))  # read back from the panels
        assert torch.equal(table, plain)
    else:
        assert cm.head.onednn is not None
        table = cm.model.embed_tokens.weight
        assert cm.lm_head.weight is table and torch.equal(table, plain)
    assert table.shape == (cm.config.vocab_size, cm.config.hidden_size)
    hidden = torch.randn(3, cm.config.hidden_size, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(torch.bfloat16)
    want = F.linear(hidden, table).float()
    torch.testing.assert_close(cm.logits(hidden), want, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_plan_counts_the_tied_head_copy(checkpoint_dir, tied) -> None:
    """Preflight's weight bytes are what the bf16 model holds: a tied head's oneDNN copy (a host
    without bf16 dot products) is a second vocab x hidden table beside the embedding, counted
    once more; the packed head (a host with them) is the embedding's only copy, nothing more.
    Packed panels round each projection's columns up to whole panels (and bf16's rows to whole
    pairs), which preflight leaves out as it does for float32: none at SmolLM's shapes, here
    the tiny model's odd widths, counted exactly below."""
    model_dir = checkpoint_dir("llama", **({"tie_word_embeddings": True} if tied else {}))
    llm = LLM(str(model_dir), dtype="bfloat16", kv_pool_tokens=256, context_length=64)
    cm = llm.engine.runner.model
    copy = cm.config.vocab_size * cm.config.hidden_size * 2
    packed = llm.engine.runner.packed_linear
    projs = [cm.head] + [p for layer in cm.model.layers
                         for p in (layer.self_attn.qkv, layer.self_attn.o,
                                   *layer.ffn.projections())]
    padding = sum(p.nbytes() - p.k * p.n * 2 for p in projs if p is not None and packed)
    assert llm.engine.plan.model_bytes + padding == cm.weight_bytes()
    fp32 = LLM(str(model_dir), kv_pool_tokens=256, context_length=64)
    extra = copy if tied and not packed else 0
    assert llm.engine.plan.model_bytes == fp32.engine.plan.model_bytes // 2 + extra


@pytest.mark.parametrize("mkldnn", [False, True])
def test_preflight_and_runner_share_the_onednn_rule(monkeypatch, checkpoint_dir, mkldnn) -> None:
    """The preflight counts a tied head's oneDNN copy exactly when the runner makes one: on a
    torch built without oneDNN the runner keeps torch's matmuls, and the preflight must not
    charge the pool a copy that never exists (it did, from a copy of the runner's rule that
    left the oneDNN check out)."""
    from kvfence.model import kernels

    monkeypatch.setattr(kernels, "packed_gemm_bf16", lambda: None)  # a host without bf16 dots
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: mkldnn)
    model_dir = checkpoint_dir("llama", tie_word_embeddings=True)
    llm = LLM(str(model_dir), dtype="bfloat16", kv_pool_tokens=256, context_length=64)
    cm = llm.engine.runner.model
    assert llm.engine.runner.onednn_linear is mkldnn
    assert (cm.head is not None and cm.head.onednn is not None) is mkldnn
    assert llm.engine.plan.model_bytes == cm.weight_bytes()
