"""The native paged decode kernel (kvfence/model/kernels): same answers as torch's gather + SDPA,
reads only the slots a row owns, and refuses a page table that points outside the pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts

from kvfence.config import ConfigError, EngineConfig
from kvfence.engine.llm import LLM
from kvfence.engine.request import SamplingParams
from kvfence.model import kernels

PAGE = 16


@pytest.fixture(scope="module")
def kernel():
    k = kernels.paged_decode()
    # CI installs g++ (.ci/run): a missing kernel there is a failure, not a skip.
    assert k is not None, "the native kernel did not build; see the warning in the log"
    return k


def reference(q, kc, vc, table, ctx, window):
    """One row at a time: SDPA over exactly the slots the row may read."""
    rows = []
    for b in range(q.shape[0]):
        n = int(ctx[b])
        t = torch.arange(max(0, n - window) if window else 0, n)
        slots = table[b][t // PAGE] * PAGE + t % PAGE
        k, v = kc[slots].transpose(0, 1).float(), vc[slots].transpose(0, 1).float()
        o = F.scaled_dot_product_attention(
            q[b][:, None].float(), k, v, enable_gqa=True, scale=q.shape[-1] ** -0.5
        )
        rows.append(o[:, 0])
    return torch.stack(rows)


def random_case(heads, kv_heads, ctx_lens, dtype=torch.float32, seed=0, pages=64, d=32):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(pages * PAGE, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(pages * PAGE, kv_heads, d, generator=g).to(dtype)
    width = max(-(-n // PAGE) for n in ctx_lens)
    perm = torch.randperm(pages - 1, generator=g)[: len(ctx_lens) * width] + 1
    table = perm.view(len(ctx_lens), width)
    q = torch.randn(len(ctx_lens), heads, d, generator=g).to(dtype)
    return q, kc, vc, table, torch.tensor(ctx_lens, dtype=torch.int64)


# Few rows: the kernel splits each row's heads across jobs; many rows: one job per row.
CTX_SETS = {"few": [1, 15, 16, 17, 33, 64], "many": [1, 2, 15, 16, 17, 31, 33, 40, 64, 5, 9, 70]}


# head_dim 64 and 128 take the register-blocked float32 P.V path, 32 the generic one.
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 32), (6, 2, 64), (4, 1, 128), (10, 2, 64)])
@pytest.mark.parametrize("window", [0, 5, 20])
@pytest.mark.parametrize("rows", sorted(CTX_SETS))
def test_kernel_equals_sdpa_over_the_rows_own_slots(kernel, heads, kv_heads, d, window, rows):
    q, kc, vc, table, ctx = random_case(heads, kv_heads, CTX_SETS[rows], pages=128, d=d)
    got = kernel(q, kc, vc, table, ctx, PAGE, q.shape[-1] ** -0.5, window)
    torch.testing.assert_close(got, reference(q, kc, vc, table, ctx, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 32), (6, 2, 64), (4, 1, 128)])
def test_kernel_bf16_vector_paths_equal_sdpa(kernel, heads, kv_heads, d, window) -> None:
    """bf16 caches take the float32 paths' 16-slot scores and register-blocked P.V (loads widen
    to float32 exactly): SDPA's answer over the bf16 values, to bf16 output rounding."""
    q, kc, vc, table, ctx = random_case(heads, kv_heads, CTX_SETS["many"], torch.bfloat16,
                                        pages=128, d=d)
    got = kernel(q, kc, vc, table, ctx, PAGE, d**-0.5, window)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(
        got.float(), reference(q, kc, vc, table, ctx, window), atol=1e-2, rtol=2**-7
    )
    kc_p, vc_p = poisoned_outside(kc, vc, table, ctx, window)
    assert torch.equal(kernel(q, kc_p, vc_p, table, ctx, PAGE, d**-0.5, window), got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision_caches(kernel, dtype) -> None:
    q, kc, vc, table, ctx = random_case(6, 2, [3, 40], dtype=dtype)
    got = kernel(q, kc, vc, table, ctx, PAGE, q.shape[-1] ** -0.5, 0)
    assert got.dtype == dtype
    torch.testing.assert_close(
        got.float(), reference(q, kc, vc, table, ctx, 0), atol=2e-2, rtol=2e-2
    )


def poisoned_outside(kc, vc, table, ctx, window):
    """NaN in every slot of the pool that no row may read (stale tails, other pages, the part
    of the context before a sliding window)."""
    allowed = torch.zeros(kc.shape[0], dtype=torch.bool)
    for b in range(table.shape[0]):
        n = int(ctx[b])
        t = torch.arange(max(0, n - window) if window else 0, n)
        allowed[table[b][t // PAGE] * PAGE + t % PAGE] = True
    kc, vc = kc.clone(), vc.clone()
    kc[~allowed], vc[~allowed] = float("nan"), float("nan")
    return kc, vc


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("rows", sorted(CTX_SETS))
@pytest.mark.parametrize("d", [32, 64])
def test_kernel_never_reads_a_slot_the_row_does_not_own(kernel, window, rows, d) -> None:
    q, kc, vc, table, ctx = random_case(6, 2, CTX_SETS[rows], pages=128, d=d)
    want = kernel(q, kc, vc, table, ctx, PAGE, 0.2, window)
    kc_p, vc_p = poisoned_outside(kc, vc, table, ctx, window)
    got = kernel(q, kc_p, vc_p, table, ctx, PAGE, 0.2, window)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)


def test_twin_reading_the_whole_last_page_shows_the_poison(kernel) -> None:
    """The check above can fail: a kernel call that reads each row's last page to its end (the
    stale tail) picks up the NaN."""
    q, kc, vc, table, ctx = random_case(6, 2, [1, 15, 17, 50], d=64)
    kc_p, vc_p = poisoned_outside(kc, vc, table, ctx, 0)
    whole_pages = (ctx + PAGE - 1) // PAGE * PAGE
    got = kernel(q, kc_p, vc_p, table, whole_pages, PAGE, 0.2, 0)
    assert not torch.isfinite(got).all()


def test_kernel_rejects_tables_outside_the_pool(kernel) -> None:
    q, kc, vc, table, ctx = random_case(4, 2, [20, 3])
    bad = table.clone()
    bad[0, 1] = kc.shape[0] // PAGE  # one page past the end
    with pytest.raises(RuntimeError, match="outside the pool|out of the pool"):
        kernel(q, kc, vc, bad, ctx, PAGE, 0.2, 0)
    with pytest.raises(RuntimeError, match="page table"):
        kernel(q, kc, vc, table[:, :1], ctx, PAGE, 0.2, 0)  # 20 tokens need 2 pages
    with pytest.raises(RuntimeError, match="page table"):
        kernel(q, kc, vc, table, torch.tensor([0, 3]), PAGE, 0.2, 0)  # an empty context


def test_engine_native_and_torch_backends_agree(kernel, checkpoint_dir) -> None:
    """Greedy answers of a staggered continuous batch are the same on both attention paths
    (the HF equivalence tests run with the default, native, backend)."""
    model = str(checkpoint_dir("qwen2"))
    prompts = random_prompts([3, 17, 40, 70], vocab=256, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = {}
    for backend in ("native", "torch"):
        llm = LLM(model, kv_pool_tokens=512, context_length=128, attention_backend=backend)
        want = {"native": "cpu_native", "torch": "reference"}[backend]
        assert llm.engine.runner.attention.name == want
        out[backend] = [c.token_ids for c in llm.generate(prompts, params)]
    assert out["native"] == out["torch"]


def test_attention_backend_flag_is_validated() -> None:
    with pytest.raises(ConfigError, match="--attention-backend"):
        EngineConfig(model="m", attention_backend="flash")
    with pytest.raises(ConfigError, match="CPU-only"):
        EngineConfig(model="m", device="cuda", attention_backend="native")
