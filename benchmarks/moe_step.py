"""Decode step time of a small mixture-of-experts model against a dense model that reads the same
weight bytes per token (its MLP as wide as the top-k experts together), and the share of the MoE
step spent routing and grouping (router, sort by expert, gathers, weighted scatter-add: the
expert block's time less its experts' matmuls).

Both models are random Qwen3-shaped checkpoints built here (Qwen3-MoE and Qwen3), float32, on the
engine's default linear backend; a step is timed around engine.step() with every request
decoding. The expert block's parts are timed by wrapping SparseMoE.forward and its per-expert
call (CPU: synchronous, so wall time is the op time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    machine,
    random_prompts,
    this_command,
    write_json,
    write_wordlevel_tokenizer,
)

SHAPES = {
    # hidden 512, 6 layers, 16 experts of 256, top 4: 4 * 256 = a dense intermediate of 1024.
    "small": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
                  moe_intermediate_size=256, vocab_size=8192),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, vocab_size=512),
}  # fmt: skip


def build(kind: str, shape: dict, out: Path) -> Path:
    import torch
    import transformers as tf

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    common = {k: v for k, v in shape.items() if not k.startswith(("num_experts", "moe_"))}
    common.update(max_position_embeddings=1024, tie_word_embeddings=False)
    if kind == "moe":
        cfg = tf.Qwen3MoeConfig(**shape, max_position_embeddings=1024, norm_topk_prob=True,
                                intermediate_size=shape["moe_intermediate_size"])
        cls = tf.Qwen3MoeForCausalLM
    else:
        inter = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
        cfg, cls = tf.Qwen3Config(**common, intermediate_size=inter), tf.Qwen3ForCausalLM
    torch.manual_seed(0)
    cls(cfg).eval().save_pretrained(out, safe_serialization=True)
    write_wordlevel_tokenizer(out, shape["vocab_size"])
    return out


class BlockTimer:
    """Wall time inside SparseMoE.forward and inside its experts' matmuls."""

    def __init__(self) -> None:
        from kvfence.model.moe import SparseMoE

        self.block = self.experts = 0.0
        self.on = False
        fwd, expert = SparseMoE.forward, SparseMoE._expert

        def timed_forward(this, *args):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            y = fwd(this, *args)
            if self.on:
                self.block += time.perf_counter() - t
            return y

        def timed_expert(this, *args):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            y = expert(this, *args)
            if self.on:
                self.experts += time.perf_counter() - t
            return y

        SparseMoE.forward, SparseMoE._expert = timed_forward, timed_expert  # type: ignore[method-assign]


def decode_steps(
    model: Path, batch: int, steps: int, timer: BlockTimer | None, profile: bool = False,
    linear_backend: str = "auto",
) -> dict:
    from kvfence.engine.llm import LLM
    from kvfence.engine.request import GenerateRequest, SamplingParams

    llm = LLM(str(model), kv_pool_tokens=batch * 64 + 256, context_length=64 + steps + 8,
              linear_backend=linear_backend)
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    for i, p in enumerate(random_prompts(batch, 32, vocab, seed=5)):
        engine.submit(GenerateRequest(f"r{i}", "t", tuple(p), params), lambda o: None)
    while any(not s.in_decode for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everyone first: the timed steps are decode only
    engine.step()
    times = []
    if timer is not None:
        timer.block = timer.experts = 0.0
        timer.on = True
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    if timer is not None:
        timer.on = False
    table = ""
    if profile:  # torch's own view of a few more decode steps, by op
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                engine.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(table)
    total = sum(times)
    out = {
        "batch": batch,
        "step_ms_median": statistics.median(times) * 1000,
        "step_ms_min": min(times) * 1000,
        "weight_bytes_resident": engine.model.weight_bytes(),
    }
    if table:
        out["torch_profile_top_ops"] = table
    if timer is not None:
        out["moe_block_share"] = timer.block / total
        out["routing_grouping_share"] = (timer.block - timer.experts) / total
        out["expert_matmul_share"] = timer.experts / total
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="a 2-layer pair (smoke test)")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--profile", action="store_true", help="torch profiler table of MoE steps")
    p.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "native"])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="moe_step")
    a = p.parse_args(argv)
    import torch

    cmd = this_command()
    shape = SHAPES["tiny" if a.tiny else "small"]
    root = Path(tempfile.gettempdir()) / f"kvfence-bench-moe-{'tiny' if a.tiny else 'small'}"
    moe, dense = build("moe", shape, root / "moe"), build("dense", shape, root / "dense")
    timer = BlockTimer()
    rows = []
    for b in (int(x) for x in a.batches.split(",")):
        m = decode_steps(moe, b, a.steps, timer, a.profile, a.linear_backend)
        d = decode_steps(dense, b, a.steps, None, linear_backend=a.linear_backend)
        rows.append({"batch": b, "moe": m, "dense": d,
                     "moe_over_dense": m["step_ms_median"] / d["step_ms_median"]})
        print(f"batch {b}: MoE {m['step_ms_median']:.2f} ms/step, dense same bytes/token "
              f"{d['step_ms_median']:.2f} ms/step ({rows[-1]['moe_over_dense']:.2f}x); "
              f"routing+grouping {m['routing_grouping_share']:.0%} of the MoE step, expert "
              f"matmuls {m['expert_matmul_share']:.0%}")
    write_json(Path(a.out) / f"{a.name}.json", {
        "command": cmd, "machine": machine(), "torch_threads": torch.get_num_threads(),
        "shape": shape, "linear_backend": a.linear_backend, "rows": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
