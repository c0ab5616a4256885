"""What the prefix cache costs when nothing is reused (issue 16, point 7: <= 2% throughput on
random prompts), measured in one process, where the HTTP run's spread (+-12% per pair) cannot
hide a 2% effect:

  A/B     two engines of the same checkpoint, cache on and cache off, both up for the whole
          run; each pair sends the same fresh random prompts through one, then the other (the
          side that goes first alternating), and takes the ratio of their throughputs. Reported:
          the mean ratio with a 95% interval (t on the logs), the median and the range.
  direct  the cache-on engine's wall time inside the cache's own code (every PrefixCache method
          and the pool's and scheduler's prefix entry points, outermost call only), as a share
          of its wall time: the cost with the machine's noise taken out.

    .venv/bin/python benchmarks/prefix_overhead.py --pairs 40
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # after PYTHONPATH

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
from kvfence.engine.request import SamplingParams  # noqa: E402
from kvfence.engine.scheduler import Scheduler  # noqa: E402
from kvfence.kv.pool import KVPool  # noqa: E402
from kvfence.kv.prefix import PrefixCache  # noqa: E402


class CacheClock:
    """Wall time spent inside the cache's code: wraps the given methods so that only the
    outermost of nested calls (the pool's seal calls the cache's) is counted."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0

    def wrap(self, cls: type, names: list[str]) -> None:
        for name in names:
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args: object, **kwargs: object) -> object:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self._depth -= 1

        return timed


def cache_methods() -> dict[type, list[str]]:
    """Every public PrefixCache method, and the prefix entry points of the pool and scheduler
    (what runs only because the cache is on)."""
    public = [
        n
        for n, v in vars(PrefixCache).items()
        if callable(v) and not n.startswith("__") and not isinstance(v, property)
    ]
    return {
        PrefixCache: public,
        KVPool: ["match_prefix", "seal", "release_prefix", "expire_prefix"],
        Scheduler: ["_lookup"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: build the SmolLM-135M-shaped one")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--pairs", type=int, default=40)
    p.add_argument("--prompts", type=int, default=8, help="random prompts per run (one batch)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--pool-tokens", type=int, default=23_000)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="prefix_overhead")
    a = p.parse_args(argv)

    model = str(bench_model(a.model, a.tiny))
    clock = CacheClock()
    for cls, names in cache_methods().items():
        clock.wrap(cls, names)
    common = {"kv_pool_tokens": a.pool_tokens, "context_length": 2048}
    engines = {
        "on": LLM(model, enable_prefix_caching=True, **common),
        "off": LLM(model, enable_prefix_caching=False, **common),
    }
    vocab = engines["on"].engine.model.config.vocab_size
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
    tokens_per_run = a.prompts * (a.input_len + a.output_len)

    def run(side: str, seed: int) -> tuple[float, float]:
        """(tokens/s, seconds inside the cache's code) of one run on one side."""
        prompts = random_prompts(a.prompts, a.input_len, vocab, seed)
        before = clock.seconds
        t0 = time.perf_counter()
        out = engines[side].generate(prompts, params)
        wall = time.perf_counter() - t0
        assert all(len(c.token_ids) == a.output_len for c in out), "a run came back short"
        return tokens_per_run / wall, clock.seconds - before

    for side in engines:  # warm-up: first-call costs land on neither side's pairs
        run(side, 10_000)
    pairs: list[dict] = []
    on_wall = on_cache = 0.0
    for i in range(a.pairs):
        order = ["on", "off"] if i % 2 == 0 else ["off", "on"]
        res = {side: run(side, 20_000 + i) for side in order}
        tps_on, cache_s = res["on"]
        on_wall += tokens_per_run / tps_on
        on_cache += cache_s
        pairs.append({"on": tps_on, "off": res["off"][0], "ratio": tps_on / res["off"][0]})
        print(f"pair {i + 1}/{a.pairs}: on/off {pairs[-1]['ratio']:.3f}", flush=True)
    ratios = [x["ratio"] for x in pairs]
    summary = {
        "ratio_on_over_off": ratio_ci(ratios),
        "median": statistics.median(ratios),
        "range": [min(ratios), max(ratios)],
        "cache_code_share_of_on_wall": on_cache / on_wall,
        "cache_code_ms_per_run": 1e3 * on_cache / a.pairs,
        "on_tok_s_median": statistics.median(x["on"] for x in pairs),
        "off_tok_s_median": statistics.median(x["off"] for x in pairs),
    }
    ci = summary["ratio_on_over_off"]
    print(
        f"throughput cache on / off: mean {ci['mean']:.4f} (95% CI {ci['lo']:.4f}-{ci['hi']:.4f}),"
        f" median {summary['median']:.4f}, range {min(ratios):.3f}-{max(ratios):.3f};"
        f" inside the cache's code: {100 * summary['cache_code_share_of_on_wall']:.3f}% of the"
        f" cache-on wall time ({summary['cache_code_ms_per_run']:.2f} ms per run)"
    )
    write_json(
        Path(a.out) / f"{a.name}.json",
        {"command": this_command(), "machine": machine(), "summary": summary, "pairs": pairs},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
