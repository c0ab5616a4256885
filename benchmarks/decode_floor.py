"""Batch-1 decode time per token against the memory-bandwidth floor: every weight is read once
per token (the tied embedding once, as the LM head), so the floor is weight bytes / the read
bandwidth measured here by summing a large tensor with the same threads.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    bench_model,
    machine,
    new_figure,
    plot_available,
    random_prompts,
    save_figure,
    this_command,
    write_json,
)


def read_bandwidth(nbytes: int, repeats: int) -> float:
    import torch

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bandwidth-mib", type=int, default=1024)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="decode_floor")
    a = p.parse_args(argv)
    import torch

    from kvfence.engine.llm import LLM
    from kvfence.engine.request import SamplingParams

    out = Path(a.out)
    cmd = this_command()
    model = bench_model(a.model, a.tiny)
    llm = LLM(
        str(model),
        context_length=a.prompt_len + a.output_len + 16,
        kv_pool_tokens=4 * (a.prompt_len + a.output_len + 16),
    )
    weight_bytes = llm.engine.model.weight_bytes()  # tied weights once, packed panels included
    prompt = random_prompts(1, a.prompt_len, llm.engine.model.config.vocab_size, seed=3)

    def timed(m: int) -> float:
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    timed(2)
    per_token, bandwidth = [], []
    for _ in range(a.repeats):  # interleave the two measurements so drift hits both
        t1 = timed(1)
        tn = timed(a.output_len + 1)
        per_token.append((tn - t1) / a.output_len)
        bandwidth.append(read_bandwidth(a.bandwidth_mib << 20, 3))
    ms = min(per_token) * 1000
    bw = max(bandwidth)
    floor_ms = weight_bytes / bw * 1000
    result = {
        "command": cmd,
        "machine": machine(),
        "model": str(model),
        "torch_threads": torch.get_num_threads(),
        "weight_bytes": weight_bytes,
        "read_bandwidth_GBps": bw / 1e9,
        "decode_ms_per_token": ms,
        "decode_ms_per_token_all": [x * 1000 for x in per_token],
        "floor_ms_per_token": floor_ms,
        "ratio_to_floor": ms / floor_ms,
    }
    print(
        f"weights {weight_bytes / 1e6:.1f} MB, read bandwidth {bw / 1e9:.2f} GB/s -> floor "
        f"{floor_ms:.2f} ms/token; kvfence batch-1 decode {ms:.2f} ms/token "
        f"({ms / floor_ms:.2f}x the floor)"
    )
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        fig, ax = new_figure(figsize=(5, 4))
        ax.bar(["bandwidth floor", "kvfence batch-1"], [floor_ms, ms], color=["C7", "C0"])
        ax.axhline(2 * floor_ms, color="r", ls="--", lw=0.8, label="2x floor (goal)")
        ax.set_ylabel("ms per decoded token")
        ax.set_title(f"{weight_bytes / 1e6:.0f} MB of weights, {bw / 1e9:.1f} GB/s read")
        ax.legend()
        save_figure(fig, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
