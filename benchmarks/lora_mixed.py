"""kvfence's own cost of multi-LoRA (issue 46): the same offline workload (N prompts of L tokens,
M greedy tokens each) on one engine with --enable-lora, once on the base model alone and once as
a mixed batch where the rows are spread over four adapters of rank 8, interleaved over pairs.
Prints tokens/s of each and the mixed/base ratio (mean with a 95% interval over the pairs).

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

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(out: Path, mc: ModelConfig, rank: int, seed: int) -> Path:
    """A random PEFT-format adapter on every site kvfence serves (no PEFT needed to write it)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for site in model_sites(mc):
        for name, width in site.slices:
            key = f"base_model.model.{site.module}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, site.in_dim, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(width, rank, generator=g) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def run(llm: LLM, prompts: list[list[int]], adapters: list, max_tokens: int) -> float:
    """Tokens/s of one batch: every prompt submitted at once, stepped to the end."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    done: list[str] = []

    def sink(o: RequestOutput) -> None:
        if o.finished:
            done.append(o.request_id)

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        req = GenerateRequest(secrets.token_hex(8), "bench", tuple(p), params,
                              lora=adapters[i % len(adapters)])
        engine.submit(req, sink)
    while len(done) < len(prompts):
        engine.step()
    return len(prompts) * max_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: a SmolLM-135M-shaped one)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer stand-in (smoke runs)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "lora_mixed.json")
    a = ap.parse_args()
    model = bench_model(a.model, a.tiny)
    mc = ModelConfig.from_dir(model)
    root = Path(tempfile.mkdtemp(prefix="kvfence-lora-bench-"))
    mods = tuple(f"lora{i}={write_adapter(root / f'a{i}', mc, a.rank, i)}"
                 for i in range(a.adapters))
    llm = LLM(str(model), enable_lora=True, max_loras=a.adapters, max_lora_rank=a.rank,
              lora_modules=mods, enable_prefix_caching=False,
              max_running_requests=max(a.prompts, 1),
              context_length=a.prompt_len + a.max_tokens + 16,
              kv_pool_tokens=a.prompts * (a.prompt_len + a.max_tokens + 32))
    reg = llm.engine.lora.registry
    mixed = [reg.resolve(f"lora{i}", "bench") for i in range(a.adapters)]
    vocab = mc.vocab_size
    run(llm, random_prompts(2, a.prompt_len, vocab, seed=99), [None], 2)  # warm-up
    rows = []
    for k in range(a.pairs):
        prompts = random_prompts(a.prompts, a.prompt_len, vocab, seed=k)
        order = [("base", [None]), ("mixed", mixed)]
        if k % 2:
            order.reverse()
        tps = {name: run(llm, prompts, ads, a.max_tokens) for name, ads in order}
        rows.append({**tps, "ratio": tps["mixed"] / tps["base"]})
        print(f"pair {k}: base {tps['base']:.1f} tok/s, mixed {tps['mixed']:.1f} tok/s, "
              f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    summary = ratio_ci([r["ratio"] for r in rows]) if len(rows) > 1 else {"mean": rows[0]["ratio"]}
    print(f"mixed / base throughput: {json.dumps(summary)}")
    write_json(a.out, {
        "command": this_command(), "machine": machine(), "model": str(model),
        "workload": {k: getattr(a, k) for k in ("prompts", "prompt_len", "max_tokens",
                                                 "adapters", "rank", "pairs")},
        "slot_bytes": llm.engine.lora.slots.nbytes(), "pairs": rows, "ratio": summary,
    })


if __name__ == "__main__":
    main()
