"""Boot warm-up A/B (kvfence/engine/warmup.py): fresh processes with --boot-warmup on and off,
interleaved; each times Engine.start, then serves a few 256-token prompts one at a time and
times every runner step. Prints the medians per side: what the warm-up adds to boot, and that
the steps after it are no slower (the warm-up must leave the step loop as it found it).

    python benchmarks/boot_warmup.py --pairs 3 --dtype float32   # ~1 min a pair, 135M model
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import bench_model, random_prompts, shape_ctx  # noqa: E402


def child(warm: bool, dtype: str, tiny: bool, prompts: int) -> dict[str, object]:
    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine
    from kvfence.engine.request import GenerateRequest, SamplingParams

    model = bench_model(None, tiny)
    cfg = EngineConfig(model=str(model), dtype=dtype, kv_pool_tokens=65536,
                       context_length=shape_ctx(model), boot_warmup=warm)
    engine = Engine(cfg)
    t0 = time.perf_counter()
    engine.start()
    boot_ms = (time.perf_counter() - t0) * 1000
    steps: list[tuple[int, float]] = []
    real = engine.runner.run

    def run(chunks):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = real(chunks)
        steps.append((sum(c.length for c in chunks), (time.perf_counter() - t) * 1000))
        return out

    engine.runner.run = run  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    for i, prompt in enumerate(random_prompts(prompts, 256, vocab, seed=7)):  # same both sides
        done = threading.Event()
        req = GenerateRequest(f"r{i}", "bench", tuple(prompt), params)
        engine.submit(req, lambda o, d=done: o.finished and d.set())
        assert done.wait(300), "a prompt never finished"
    engine.shutdown()
    return {
        "boot_ms": boot_ms,
        "first_prefill_ms": next(ms for n, ms in steps if n > 1),
        "prefill_ms": statistics.median(ms for n, ms in steps if n > 1),
        "decode_ms": statistics.median(ms for n, ms in steps if n == 1),
        "fit": repr(engine.scheduler.step_budget.model.cost()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="the 2-layer stand-in (smoke test)")
    p.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child == "on", a.dtype, a.tiny, a.prompts)))
        return
    rows: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(a.pairs):
        for side in ("on", "off"):
            argv = [sys.executable, __file__, "--child", side, "--dtype", a.dtype,
                    "--prompts", str(a.prompts), *(["--tiny"] if a.tiny else [])]
            out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
            rows[side].append(json.loads(out.strip().splitlines()[-1]))
            print(side, rows[side][-1], flush=True)
    for key in ("boot_ms", "first_prefill_ms", "prefill_ms", "decode_ms"):
        on, off = (statistics.median(r[key] for r in rows[s]) for s in ("on", "off"))
        print(f"{key:18s} warm-up on {on:8.1f}  off {off:8.1f}  on/off {on / off:5.2f}")


if __name__ == "__main__":
    main()
