"""Multi-LoRA on the unified engine: greedy answers token-exact with transformers + PEFT (float32)
for a mixed batch of four adapters and the base model, prefix-cache hits included, on attention
and MLP projections (on an MoE family: the routed experts as PEFT targets them, and the dense
MLP and shared experts); the slot table swaps adapters LRU when they outnumber the slots; bad
checkpoints are refused at load."""

from __future__ import annotations

import json
from dataclasses import replace as dataclass_replace
from pathlib import Path

import pytest
from conftest import random_prompts
from lora_adapters import MOE_ADAPTERS, MOE_FAMILIES, SLOW, build_adapter, peft_greedy
from safetensors.torch import load_file, save_file

from kvfence.config import ConfigError
from kvfence.engine.engine import Engine
from kvfence.engine.llm import LLM
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams
from kvfence.lora.checkpoint import LoraCheckpointError

PAGE = 16
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
# Four adapters: ranks below and at --max-lora-rank (padding), one rsLoRA scaling.
ADAPTERS = [
    dict(rank=8), dict(rank=4, alpha=8.0), dict(rank=2, rslora=True), dict(rank=8, alpha=4.0)
]
def adapter_specs(arch: str) -> list[dict]:
    return MOE_ADAPTERS if arch in MOE_FAMILIES else ADAPTERS


@pytest.fixture(scope="module")
def lora_setup(checkpoint_dir, tmp_path_factory):
    cache: dict[str, tuple[Path, list[Path]]] = {}

    def get(arch: str) -> tuple[Path, list[Path]]:
        if arch not in cache:
            model = checkpoint_dir(arch)
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            cache[arch] = model, [
                build_adapter(model, root / f"a{i}", seed=10 + i, **kw)
                for i, kw in enumerate(adapter_specs(arch))
            ]
        return cache[arch]

    return get


def lora_llm(model: Path, adapters: list[Path], **kw) -> LLM:
    mods = tuple(f"a{i}={p}" for i, p in enumerate(adapters))
    args = dict(kv_pool_tokens=4096, page_size=PAGE, chunked_prefill_size=24, enable_lora=True,
                max_loras=4, max_lora_rank=8, lora_modules=mods)
    args.update(kw)
    return LLM(str(model), **args)


def run_mixed(
    engine: Engine, jobs: list[tuple[str | None, list[int]]], tenant: str = "t"
) -> tuple[list[list[int]], list[int]]:
    """Every job in one running batch (half submitted, a few steps, then the rest): tokens and
    cached prompt tokens of each."""
    outs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    done: set[str] = set()

    def sink(o: RequestOutput) -> None:
        outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        cached[o.request_id] = max(cached.get(o.request_id, 0), o.cached_tokens)
        if o.finished:
            done.add(o.request_id)

    reg = engine.lora.registry
    ids = [f"r{i}" for i in range(len(jobs))]
    half = len(jobs) // 2
    for k, (rid, (name, prompt)) in enumerate(zip(ids, jobs, strict=True)):
        if k == half:
            for _ in range(2):
                engine.step()
        lora = reg.resolve(name, tenant) if name is not None else None
        assert name is None or lora is not None
        engine.submit(GenerateRequest(rid, tenant, tuple(prompt), GREEDY, lora=lora), sink)
    while len(done) < len(ids):
        engine.step()
    return [outs[r] for r in ids], [cached[r] for r in ids]


def peft_answers(arch: str, model: Path, adapters: list[Path], names: list[str | None],
                 prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    specs = adapter_specs(arch)
    return {n: peft_greedy(model, None if n is None else adapters[int(n[1])], prompts, NEW,
                           dense_mlp=n is not None and specs[int(n[1])].get("dense_mlp", False))
            for n in names}


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "glm4_moe", pytest.param("qwen3_moe", marks=SLOW)]
)
def test_mixed_batch_of_four_adapters_and_base_token_exact_with_peft(arch, lora_setup) -> None:
    model, adapters = lora_setup(arch)
    prompts = random_prompts([7, PAGE + 3, 2 * PAGE + 5], vocab=256, seed=4)
    names: list[str | None] = [None, "a0", "a1", "a2", "a3"]
    jobs = [(n, p) for p in prompts for n in names]
    llm = lora_llm(model, adapters)
    got, _ = run_mixed(llm.engine, jobs)
    want = peft_answers(arch, model, adapters, names, prompts)
    for (name, prompt), g in zip(jobs, got, strict=True):
        assert g == want[name][prompts.index(prompt)], f"{arch} {name}: {len(prompt)} tokens"
    assert len({tuple(want[n][2]) for n in names}) == len(names), "adapters must change answers"
    # The same jobs again: every prompt's full pages come from the cache of its own adapter.
    again, cached = run_mixed(llm.engine, jobs)
    assert again == got
    assert all(c == (len(p) - 1) // PAGE * PAGE for c, (_, p) in zip(cached, jobs, strict=True))
    assert max(cached) > 0
    assert llm.engine.pool.num_used == 0


def test_more_adapters_than_slots_swap_lru_and_stay_exact(lora_setup) -> None:
    model, adapters = lora_setup("llama")
    prompts = random_prompts([9, 21], vocab=256, seed=5)
    names = ["a0", "a1", "a2", "a3", None]
    jobs = [(n, p) for p in prompts for n in names]
    llm = lora_llm(model, adapters, max_loras=2, linear_backend="torch")  # the plain matmul path
    got, _ = run_mixed(llm.engine, jobs)
    slots = llm.engine.lora.slots
    assert slots.swaps > 2 and len(slots.resident()) == 2
    for (name, prompt), g in zip(jobs, got, strict=True):
        ref = None if name is None else adapters[int(name[1])]
        assert [g] == peft_greedy(model, ref, [prompt], NEW)


def test_unloaded_adapter_keeps_serving_the_requests_that_hold_it(lora_setup) -> None:
    """The documented choice: a running request finishes with the weights it started with."""
    model, adapters = lora_setup("llama")
    prompt = random_prompts([20], vocab=256, seed=6)[0]
    llm = lora_llm(model, adapters)
    reg = llm.engine.lora.registry
    outs: list[int] = []
    done: list[bool] = []

    def sink(o: RequestOutput) -> None:
        outs.extend(o.new_token_ids)
        done.append(o.finished)

    llm.engine.submit(GenerateRequest("r", "t", tuple(prompt), GREEDY, lora=reg.resolve("a1", "t")),
                      sink)
    llm.engine.step()
    reg.unload("a1")
    assert reg.resolve("a1", "t") is None
    while not any(done):
        llm.engine.step()
    assert [outs] == peft_greedy(model, adapters[1], [prompt], NEW)


def test_bad_checkpoints_are_refused_at_load(lora_setup, tmp_path) -> None:
    model, adapters = lora_setup("llama")
    with pytest.raises(ConfigError, match="exceeds --max-lora-rank 4"):
        lora_llm(model, adapters[:1], max_lora_rank=4)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapters[0] / "adapter_config.json").read_text())
    tensors = load_file(adapters[0] / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="q_proj: lora_A"):
        lora_llm(model, [bad])
    cfg = json.loads((adapters[0] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ConfigError, match="use_dora is not supported"):
        lora_llm(model, [bad])
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_parameters": ["lm_head"]}))
    with pytest.raises(ConfigError, match="target_parameters may name only the routed experts"):
        lora_llm(model, [bad])
    with pytest.raises(ConfigError, match="needs --enable-lora"):
        LLM(str(model), kv_pool_tokens=1024, lora_modules=(f"x={adapters[0]}",))
    assert issubclass(LoraCheckpointError, ValueError)


def test_slot_table_bytes_are_what_sizing_and_preflight_count(lora_setup, capsys) -> None:
    from kvfence.kv.sizing import plan_for_engine
    from kvfence.tools.preflight import main as preflight_main

    model, adapters = lora_setup("glm4_moe")  # dense layer, shared experts, routed experts
    llm = lora_llm(model, adapters[:1], kv_pool_tokens=None, mem_fraction_static=0.01)
    cfg = llm.engine.cfg
    plan = plan_for_engine(cfg, llm.engine.model_config, device_memory=2**30)
    assert plan.lora_bytes == llm.engine.lora.slots.nbytes() > 0
    base = plan_for_engine(dataclass_replace(cfg, enable_lora=False, lora_modules=()),
                           llm.engine.model_config, device_memory=2**30)
    assert base.lora_bytes == 0 and base.budget_bytes - plan.budget_bytes == plan.lora_bytes
    argv = ["--model", str(model), "--device-memory-gib", "1", "--json", "--enable-lora",
            "--max-loras", "4", "--max-lora-rank", "8"]
    preflight_main(argv)
    assert json.loads(capsys.readouterr().out)["lora_bytes"] == plan.lora_bytes
