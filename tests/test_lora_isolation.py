"""LoRA and the prefix cache: KV computed under one adapter is never reused under another, nor
under the same name reloaded with other weights, because the namespace carries the adapter's
content digest (kvfence/kv/prefix.py). The twin drops the digest from the key and the pages are
then shared, with answers no longer what the adapter computes."""

from __future__ import annotations

import pytest
from conftest import random_prompts
from lora_adapters import build_adapter, peft_greedy
from test_lora import GREEDY, NEW, PAGE, lora_llm

from kvfence.engine.engine import Engine
from kvfence.engine.request import GenerateRequest, RequestOutput
from kvfence.faults import Faults
from kvfence.lora.config import LoraModuleSpec, LoraRegistryError

PROMPT_LEN = 3 * PAGE + 4


@pytest.fixture(scope="module")
def adapters(checkpoint_dir, tmp_path_factory):
    model = checkpoint_dir("llama")
    root = tmp_path_factory.mktemp("lora-iso")
    return model, [build_adapter(model, root / f"a{i}", seed=30 + i) for i in range(3)]


def answer(engine: Engine, name: str | None, prompt: list[int], rid: str,
           tenant: str = "t") -> tuple[list[int], int]:
    out: list[int] = []
    cached: list[int] = [0]
    done: list[bool] = []

    def sink(o: RequestOutput) -> None:
        out.extend(o.new_token_ids)
        cached[0] = max(cached[0], o.cached_tokens)
        done.append(o.finished)

    lora = engine.lora.registry.resolve(name, tenant) if name is not None else None
    engine.submit(GenerateRequest(rid, tenant, tuple(prompt), GREEDY, lora=lora), sink)
    while not any(done):
        engine.step()
    return out, cached[0]


def run_pair(model, paths, faults: Faults | None = None) -> dict[str, tuple[list[int], int]]:
    """The same prompt under a0, then a1, then the base, then a0 reloaded with a1's weights."""
    llm = lora_llm(model, paths[:2], faults=faults)
    engine = llm.engine
    prompt = random_prompts([PROMPT_LEN], vocab=256, seed=8)[0]
    res = {"a0": answer(engine, "a0", prompt, "r0")}
    res["a1"] = answer(engine, "a1", prompt, "r1")
    res["base"] = answer(engine, None, prompt, "r2")
    res["a0 again"] = answer(engine, "a0", prompt, "r3")
    engine.lora.registry.unload("a0")
    engine.lora.registry.load(LoraModuleSpec("a0", str(paths[1])))
    res["a0 reloaded"] = answer(engine, "a0", prompt, "r4")
    engine.lora.registry.unload("a1")
    engine.lora.registry.load(LoraModuleSpec("a1", str(paths[2])))
    res["a1 new weights"] = answer(engine, "a1", prompt, "r5")
    res["prompt"] = (prompt, 0)
    return res


def test_same_prompt_under_two_adapters_or_a_reload_never_shares_pages(adapters) -> None:
    model, paths = adapters
    res = run_pair(model, paths)
    prompt = res["prompt"][0]
    full = (PROMPT_LEN - 1) // PAGE * PAGE
    assert res["a0"][1] == 0
    assert res["a1"][1] == 0, "a1 reused a0's pages"
    assert res["base"][1] == 0, "the base model reused an adapter's pages"
    assert res["a0 again"][1] == full  # the cache works: a0's own pages
    # The reload under the same name holds other weights: a0's old pages are not its pages, but
    # a1's are (same digest: the same weights compute the same KV).
    assert res["a0 reloaded"][1] == full
    assert res["a1 new weights"][1] == 0, "a reload with other weights reused the old KV"
    assert res["a0"][0] == peft_greedy(model, paths[0], [prompt], NEW)[0]
    assert res["a1"][0] == res["a0 reloaded"][0] == peft_greedy(model, paths[1], [prompt], NEW)[0]
    assert res["base"][0] == peft_greedy(model, None, [prompt], NEW)[0]


def test_twin_dropping_the_digest_from_the_key_shares_pages_across_adapters(adapters) -> None:
    model, paths = adapters
    faults = Faults()
    faults.arm("lora_key_drops_digest")
    res = run_pair(model, paths, faults)
    prompt = res["prompt"][0]
    # The breach: a0's pages read by a1, by the base model and by a reload with other weights.
    assert res["a1"][1] > 0 and res["base"][1] > 0 and res["a1 new weights"][1] > 0
    assert res["a1"][0] != peft_greedy(model, paths[1], [prompt], NEW)[0]


def test_registry_refuses_a_second_adapter_under_a_served_name(adapters) -> None:
    model, paths = adapters
    llm = lora_llm(model, paths[:2])
    reg = llm.engine.lora.registry
    with pytest.raises(LoraRegistryError, match="already loaded"):
        reg.load(LoraModuleSpec("a0", str(paths[1])))
    with pytest.raises(LoraRegistryError, match="base model's name"):
        reg.load(LoraModuleSpec(llm.engine.model_name, str(paths[1])))
    with pytest.raises(LoraRegistryError) as e:
        reg.unload("nope")
    assert e.value.status == 404
