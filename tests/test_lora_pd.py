"""LoRA across PD: RESERVE names the adapter decode resolved (name and content digest); prefill
computes with the adapter of that digest or refuses the room; DONE says which adapter prefill
applied and decode commits only if it is the one it holds (I3; the twin turns that check off).
Greedy answers of a mixed batch (four adapters and the base) are token-exact with PEFT, prefix
hits on decode's cache included, for llama and an MoE family (routed experts, dense MLP and
shared experts; qwen3 with RUN_SLOW=1)."""

from __future__ import annotations

import pytest
from conftest import random_prompts
from lora_adapters import MOE_ADAPTERS, MOE_FAMILIES, SLOW, build_adapter, peft_greedy
from pd_harness import PDPair, Result, _sink, finished_ok

from kvfence.engine.request import GenerateRequest, SamplingParams
from kvfence.faults import Faults
from kvfence.pd import protocol as p

PAGE = 16
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def specs(arch: str) -> list[dict]:
    if arch in MOE_FAMILIES:
        return MOE_ADAPTERS
    return [dict(rank=8 - 2 * i) for i in range(4)]


@pytest.fixture(scope="module")
def family(checkpoint_dir, tmp_path_factory):
    cache: dict[str, tuple] = {}

    def get(arch: str) -> tuple:
        if arch not in cache:
            model = checkpoint_dir(arch)
            root = tmp_path_factory.mktemp(f"lora-pd-{arch}")
            cache[arch] = model, [build_adapter(model, root / f"a{i}", seed=70 + i, **kw)
                                  for i, kw in enumerate(specs(arch))]
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def lora_model(family):
    return family("llama")


def lora_pair(model, prefill_paths, decode_paths=None) -> PDPair:
    mods = tuple(f"a{i}={q}" for i, q in enumerate(prefill_paths))
    dmods = tuple(f"a{i}={q}" for i, q in enumerate(decode_paths or prefill_paths))
    return PDPair(str(model), kv_pool_tokens=2048, context_length=256, page_size=PAGE,
                  chunked_prefill_size=64, enable_lora=True, max_loras=4, max_lora_rank=8,
                  lora_modules=mods, decode_kwargs={"lora_modules": dmods})


def ask(pd: PDPair, jobs: list[tuple[str | None, list[int]]]) -> list[Result]:
    reg = pd.decode.engine.lora.registry
    out = []
    for k, (name, prompt) in enumerate(jobs):
        res = Result()
        lora = reg.resolve(name, "t") if name is not None else None
        req = GenerateRequest(f"{pd._n:08x}{k:024x}", "t", tuple(prompt), GREEDY, pd.peer,
                              lora=lora)
        pd.decode.submit(req, _sink(res))
        out.append(res)
    pd._n += 1
    for r in out:
        assert r.done.wait(120), "request did not finish"
    return out


@pytest.mark.parametrize("arch", ["llama", "glm4_moe", pytest.param("qwen3", marks=SLOW)])
def test_pd_mixed_adapters_token_exact_with_peft_and_decode_cache_hits(arch, family) -> None:
    model, paths = family(arch)
    prompts = random_prompts([9, 2 * PAGE + 3], vocab=256, seed=12)
    names: list[str | None] = [None, "a0", "a1", "a2", "a3"]
    jobs = [(n, q) for q in prompts for n in names]
    pd = lora_pair(model, paths)
    try:
        first = ask(pd, jobs)
        again = ask(pd, jobs)
        assert pd.wait_idle()
    finally:
        pd.close()
    dense = [kw.get("dense_mlp", False) for kw in specs(arch)]
    want = {n: peft_greedy(model, None if n is None else paths[int(n[1])], prompts, NEW,
                           dense_mlp=n is not None and dense[int(n[1])])
            for n in names}
    for (name, prompt), r1, r2 in zip(jobs, first, again, strict=True):
        assert finished_ok(r1) and finished_ok(r2)
        assert r1.token_ids == r2.token_ids == want[name][prompts.index(prompt)], name
    assert max(r.final.cached_tokens for r in again) == 2 * PAGE  # decode's own adapter pages


def test_pd_prefill_refuses_an_adapter_digest_it_does_not_hold(lora_model) -> None:
    model, paths = lora_model
    # Same name, other weights on prefill: decode's digest is not there.
    pd = lora_pair(model, [paths[1]], [paths[0]])
    try:
        (r,) = ask(pd, [("a0", random_prompts([20], vocab=256, seed=13)[0])])
        assert r.final is not None and r.final.error_code == "lora_not_held"
        assert r.final.error_status == 500 and not r.token_ids
        assert pd.wait_idle()
    finally:
        pd.close()


def _done_against(lora_digest: str, guards) -> tuple:
    room = p.DecodeRoom("r", 1, 1, received=frozenset({0}), checksums=((0, 5),),
                        lora_digest="sha256:decode")
    done = p.Done("r", 1, 1, p.digest_of(((0, 5),), 1), 7, lora_digest=lora_digest)
    return p.decode_step(room, p.DoneArrived(done, pool_digest_ok=True), guards)


def test_decode_refuses_kv_computed_with_another_adapter() -> None:
    guards = Faults().guards()
    room, actions = _done_against("sha256:other", guards)
    assert not any(isinstance(a, p.Commit) for a in actions)
    assert any(isinstance(a, p.FailClient) for a in actions)
    _, actions = _done_against("sha256:decode", guards)
    assert any(isinstance(a, p.Commit) for a in actions)


def test_twin_without_the_pd_adapter_check_decode_commits_the_wrong_kv() -> None:
    faults = Faults()
    faults.arm("lora_skip_pd_digest")
    _, actions = _done_against("sha256:other", faults.guards())
    assert any(isinstance(a, p.Commit) for a in actions)
