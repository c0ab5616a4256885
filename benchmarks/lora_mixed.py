"""kvfence's own cost of multi-LoRA (issue 46): the same offline workload (N prompts of L tokens,
M greedy tokens each) on the base model alone (an engine without --enable-lora) and as a mixed
batch on an engine with --enable-lora whose rows are spread round-robin over four adapters of
rank 8, interleaved over pairs. Prints tokens/s of each and the mixed/base ratio (mean with a
95% interval over the pairs).

    .venv/bin/python benchmarks/lora_mixed.py                       # 32 x 256 -> 64, SmolLM shape
    .venv/bin/python benchmarks/lora_mixed.py --tiny --prompts 4 --prompt-len 16 --max-tokens 4
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.common import (  # noqa: E402
    RESULTS,
    add_lora_workload_args,
    bench_model,
    machine,
    random_prompts,
    ratio_ci,
    this_command,
    write_json,
)
from kvfence.engine.llm import LLM  # noqa: E402
from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams  # noqa: E402
from kvfence.lora.sites import model_sites  # noqa: E402
from kvfence.model.config import ModelConfig  # noqa: E402

# Large enough that the adapters change greedy answers (the vLLM A/B counts the prompts both
# engines answer alike: a check only if the adapters matter).
STD = 0.1
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, mc: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT-format adapter on every attention and MLP projection (the routed experts of
    an MoE model excepted), written without PEFT."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for site in model_sites(mc):
        if site.experts:
            continue
        for name, width in site.slices:
            key = f"base_model.model.{site.module}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, site.in_dim, generator=g) * STD
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, rank, generator=g) * STD
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def write_adapters(mc: ModelConfig, n: int, rank: int) -> list[str]:
    """n random adapters in a fresh temporary directory, as --lora-modules entries."""
    root = Path(tempfile.mkdtemp(prefix="kvfence-lora-bench-"))
    return [f"lora{i}={write_adapter(root / f'a{i}', mc, rank, i)}" for i in range(n)]


def bench_llm(model: Path, prompts: int, prompt_len: int, max_tokens: int, lora_modules: list[str],
              rank: int) -> LLM:
    """The engine a LoRA benchmark runs: defaults, no prefix cache (fresh prompts each round
    anyway), room for every prompt at once; --enable-lora only when there are adapters."""
    lora = dict(enable_lora=True, max_loras=len(lora_modules), max_lora_rank=rank,
                lora_modules=tuple(lora_modules)) if lora_modules else {}
    return LLM(str(model), enable_prefix_caching=False, max_running_requests=max(prompts, 1),
               context_length=prompt_len + max_tokens + 16,
               kv_pool_tokens=prompts * (prompt_len + max_tokens + 32), **lora)


def run(
    llm: LLM, prompts: list[list[int]], adapters: list, max_tokens: int,
    tokens: list[list[int]] | None = None,
) -> float:
    """Output tokens/s of one batch: every prompt submitted at once (prompt i with adapter
    i mod len(adapters)), stepped to the end; each prompt's greedy tokens into `tokens`."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [secrets.token_hex(8) for _ in prompts]
    outs: dict[str, list[int]] = {i: [] for i in ids}
    done: list[str] = []

    def sink(o: RequestOutput) -> None:
        outs[o.request_id].extend(o.new_token_ids)
        if o.finished:
            done.append(o.request_id)

    t0 = time.perf_counter()
    for i, (rid, p) in enumerate(zip(ids, prompts, strict=True)):
        req = GenerateRequest(rid, "bench", tuple(p), params, lora=adapters[i % len(adapters)])
        engine.submit(req, sink)
    while len(done) < len(prompts):
        engine.step()
    wall = time.perf_counter() - t0
    if tokens is not None:
        tokens[:] = [outs[i] for i in ids]
    return len(prompts) * max_tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_lora_workload_args(ap)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS, help="directory of lora_mixed.json")
    a = ap.parse_args()
    model = bench_model(a.model, a.tiny)
    mc = ModelConfig.from_dir(model)
    shape = (a.prompts, a.prompt_len, a.max_tokens)
    base = bench_llm(model, *shape, [], a.rank)
    llm = bench_llm(model, *shape, write_adapters(mc, a.adapters, a.rank), a.rank)
    reg = llm.engine.lora.registry
    mixed = [reg.resolve(f"lora{i}", "bench") for i in range(a.adapters)]
    vocab = mc.vocab_size
    engines = {"base": (base, [None]), "mixed": (llm, mixed)}
    for eng, ads in engines.values():  # warm-up
        run(eng, random_prompts(2, a.prompt_len, vocab, seed=99), ads, 2)
    rows = []
    for k in range(a.pairs):
        prompts = random_prompts(a.prompts, a.prompt_len, vocab, seed=k)
        order = ["base", "mixed"] if k % 2 == 0 else ["mixed", "base"]
        tps = {}
        for name in order:
            eng, ads = engines[name]
            tps[name] = run(eng, prompts, ads, a.max_tokens)
        rows.append({**tps, "ratio": tps["mixed"] / tps["base"]})
        print(f"pair {k}: base {tps['base']:.1f} tok/s, mixed {tps['mixed']:.1f} tok/s, "
              f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    summary = ratio_ci([r["ratio"] for r in rows]) if len(rows) > 1 else {"mean": rows[0]["ratio"]}
    print(f"mixed / base throughput: {json.dumps(summary)}")
    write_json(a.out / "lora_mixed.json", {
        "command": this_command(), "machine": machine(), "model": str(model),
        "workload": {k: getattr(a, k) for k in ("prompts", "prompt_len", "max_tokens",
                                                 "adapters", "rank", "pairs")},
        "slot_bytes": llm.engine.lora.slots.nbytes(), "pairs": rows, "ratio": summary,
    })


if __name__ == "__main__":
    main()
