"""The native rope + K/V cache write (rope_store in kvfence/model/kernels/fused_epilogue.cpp): the
same bits as torch's rotate-half rope followed by paged_attention's index_copy_, at 1..300 tokens,
any slot order and head shape; it writes the cache rows of slot_mapping and no others (I2/I3 see
exactly the torch path's writes); the engine answers the same with it, without it, and as
transformers."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts
from test_engine_equivalence import GREEDY, run_staggered

from kvfence.engine.llm import LLM
from kvfence.model import kernels
from kvfence.model.config import RopeConfig
from kvfence.model.rope import RotaryTable, Rotation

SHAPES = [(9, 3, 64), (4, 4, 128), (8, 2, 256), (5, 1, 80)]  # (heads, kv heads, head_dim)
TOKENS = [1, 2, 7, 33, 300]  # 300 tokens split over the threads
SLOTS = 512
SENTINEL = -7.25


@pytest.fixture(scope="module")
def ep():
    e = kernels.fused_epilogue()
    # CI installs g++ (.ci/run): a missing kernel there is a failure, not a skip.
    assert e is not None, "the fused epilogue kernel did not build; see the warning in the log"
    return e


def case(t: int, h: int, kvh: int, d: int, seed: int):
    """A step's packed qkv, the rotation of random positions, sentinel-filled caches and slots
    out of order with gaps."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 3
    positions = torch.randint(0, 4096, (t,), generator=g)
    rot = RotaryTable(RopeConfig(theta=10000.0), d, 4096, torch.device("cpu")).at(positions)
    slots = torch.randperm(SLOTS, generator=g)[:t]
    caches = [torch.full((SLOTS, kvh, d), SENTINEL) for _ in range(2)]
    return qkv, rot, slots, caches


def torch_path(qkv: torch.Tensor, rot: Rotation, h: int, kvh: int, d: int, k_cache, v_cache,
               slots: torch.Tensor) -> torch.Tensor:
    """What Attention.forward and paged_attention do without the kernel."""
    t = qkv.shape[0]
    qk = rot(qkv[:, : (h + kvh) * d].view(t, h + kvh, d))
    k_cache.index_copy_(0, slots, qk[:, h:])
    v_cache.index_copy_(0, slots, qkv[:, (h + kvh) * d :].view(t, kvh, d))
    return qk[:, :h]


def assert_only_rows_written(cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Every row outside `slots` still holds the sentinel; every row in it was overwritten."""
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert (cache[untouched] == SENTINEL).all(), "a row outside slot_mapping was written"
    assert (cache[slots] != SENTINEL).any(dim=(1, 2)).all(), "a slot_mapping row was not written"


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h, kvh, d", SHAPES)
def test_rope_store_equals_torch_rope_and_index_copy(ep, t, h, kvh, d) -> None:
    qkv, rot, slots, (kc, vc) = case(t, h, kvh, d, seed=t * 7919 + d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q = ep.rope_store(qkv, rot.cos, rot.sin, h, kc, vc, slots)
    q_ref = torch_path(qkv, rot, h, kvh, d, kc_ref, vc_ref, slots)
    assert q.shape == (t, h, d) and q.is_contiguous()
    assert torch.equal(q, q_ref)
    assert torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)


@pytest.mark.parametrize("t", [1, 300])
def test_rope_store_writes_only_the_slot_mapping_rows(ep, t) -> None:
    qkv, rot, slots, (kc, vc) = case(t, 9, 3, 64, seed=t)
    ep.rope_store(qkv, rot.cos, rot.sin, 9, kc, vc, slots)
    for cache in (kc, vc):
        assert_only_rows_written(cache, slots)


def test_row_check_catches_a_kernel_writing_the_wrong_slot(ep) -> None:
    """The twin of the test above: a kernel that writes each token one slot off fails it."""
    qkv, rot, slots, (kc, vc) = case(7, 9, 3, 64, seed=3)
    ep.rope_store(qkv, rot.cos, rot.sin, 9, kc, vc, (slots + 1) % SLOTS)
    with pytest.raises(AssertionError, match="outside slot_mapping"):
        assert_only_rows_written(kc, slots)


def test_rope_store_refuses_a_bad_slot_and_writes_nothing(ep) -> None:
    qkv, rot, slots, (kc, vc) = case(7, 9, 3, 64, seed=4)
    for bad in (SLOTS, -1):
        slots[-1] = bad
        with pytest.raises(RuntimeError, match="out of range"):
            ep.rope_store(qkv, rot.cos, rot.sin, 9, kc, vc, slots)
        assert (kc == SENTINEL).all() and (vc == SENTINEL).all()


def test_equality_check_catches_a_wrong_rotation(ep) -> None:
    """Mutations of the kernel's formula (sin's sign flipped, cos and sin swapped) change q and
    k: exact equality with the torch path is not vacuous."""
    qkv, rot, slots, (kc, vc) = case(33, 9, 3, 64, seed=5)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = torch_path(qkv, rot, 9, 3, 64, kc_ref, vc_ref, slots)
    for cos, sin in ((rot.cos, -rot.sin), (rot.sin, rot.cos)):
        k_wrong = kc.clone()
        q = ep.rope_store(qkv, cos, sin, 9, k_wrong, vc.clone(), slots)
        assert not torch.equal(q, q_ref)
        assert not torch.equal(k_wrong, kc_ref)


def test_rope_store_rejects_what_it_cannot_read(ep) -> None:
    qkv, rot, slots, (kc, vc) = case(2, 9, 3, 64, seed=6)
    with pytest.raises(RuntimeError, match="qkv must be"):
        ep.rope_store(qkv, rot.cos, rot.sin, 8, kc, vc, slots)
    with pytest.raises(RuntimeError, match="caches must be"):
        ep.rope_store(qkv, rot.cos, rot.sin, 9, kc.double(), vc, slots)
    with pytest.raises(RuntimeError, match="cos and sin"):
        ep.rope_store(qkv, rot.cos[:1], rot.sin, 9, kc, vc, slots)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        ep.rope_store(qkv, rot.cos, rot.sin, 9, kc, vc, slots.int())


def test_engine_rope_store_matches_torch_path_and_hf(ep, checkpoint_dir) -> None:
    """Greedy answers with the native rope + cache write equal those with torch's rope and
    index_copy_ (the rest of the epilogue on in both), and transformers', under continuous
    batching and chunked prefill."""
    model = checkpoint_dir("llama", tie_word_embeddings=True)
    prompts = random_prompts([1, 15, 17, 53, 70], vocab=256, seed=5)
    out = {}
    for native in (True, False):
        llm = LLM(str(model), kv_pool_tokens=2048, chunked_prefill_size=24)
        cm = llm.engine.runner.model
        assert cm.rope_store is not None and cm.epilogue is not None
        if not native:
            cm.rope_store = None
        out[native] = run_staggered(llm.engine, prompts, GREEDY)
    assert out[True] == out[False]
    assert out[True] == hf_greedy(model, prompts, GREEDY.max_tokens)


def test_rope_store_only_where_it_is_one_pass(checkpoint_dir) -> None:
    """Qwen3's q/k norm, a cache of another dtype than the weights' and --linear-backend torch
    keep torch's rope and index_copy_; bfloat16 weights with their bfloat16 cache use it."""
    llama, qwen3 = str(checkpoint_dir("llama")), str(checkpoint_dir("qwen3"))
    for model, kw in (
        (qwen3, {}),
        (llama, {"kv_cache_dtype": "bfloat16"}),
        (llama, {"linear_backend": "torch"}),
    ):
        llm = LLM(model, kv_pool_tokens=256, context_length=64, **kw)
        assert llm.engine.runner.model.rope_store is None, kw
    llm = LLM(llama, kv_pool_tokens=256, context_length=64, dtype="bfloat16")
    assert llm.engine.runner.model.rope_store is not None
