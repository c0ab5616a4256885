"""Structured-output cost: decode throughput of one batch with 0%, 50% and 100% of its rows
constrained by a JSON schema (in-process engine, stepped by hand, so every row shares each
step), and grammar compile time per schema (cold, then from the cache).

    .venv/bin/python benchmarks/structured.py                       # bundled tiny model
    .venv/bin/python benchmarks/structured.py --model DIR --batch 32 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import RESULTS, ROOT, machine, this_command, write_json  # noqa: E402
from kvfence.config import EngineConfig  # noqa: E402
from kvfence.engine.engine import Engine  # noqa: E402
from kvfence.engine.request import GenerateRequest, SamplingParams  # noqa: E402
from kvfence.structured.grammar import Grammars  # noqa: E402
from kvfence.structured.spec import Constraint  # noqa: E402

# Never closes on its own (unbounded strings in an unbounded list), so a constrained row decodes
# exactly as many tokens as a free one and the comparison is per token.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["notes"],
    "additionalProperties": False,
}
COMPILE_SCHEMAS = {
    "flat": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
                    "roles": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}},
                },
                "required": ["name", "email", "roles"],
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["user", "score"],
    },
    "wide_enum": {"enum": [f"option-{i}" for i in range(200)]},
}


def decode_rate(engine: Engine, batch: int, tokens: int, frac: float, seed: int) -> float:
    """Output tokens per second of the decode steps (the batch's shared prefill excluded)."""
    n_constrained = round(batch * frac)
    done = 0
    for i in range(batch):
        c = Constraint.json_schema(OPEN_SCHEMA) if i < n_constrained else None
        sp = SamplingParams(
            max_tokens=tokens, temperature=1.0, seed=seed + i, ignore_eos=True, constraint=c
        )
        prompt = tuple(engine.tokenizer.encode(f"row {i}: write notes"))
        verdict = engine.submit(GenerateRequest(f"{seed}-{frac}-{i}", "t", prompt, sp), _count)
        assert not hasattr(verdict, "code"), verdict
    engine.step()  # the prefill step (and first tokens)
    t0 = time.perf_counter()
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    dt = time.perf_counter() - t0
    done = steps * batch
    return done / dt


def _count(out: object) -> None:
    pass


def compile_times(engine: Engine) -> dict[str, dict[str, float]]:
    out = {}
    for name, schema in COMPILE_SCHEMAS.items():
        g = Grammars(engine.tokenizer.backend_json(), engine.model_config.vocab_size, [0])
        g.matcher(Constraint.json_schema({"type": "string"}), "t")  # the tokenizer, built once
        t0 = time.perf_counter()
        g.matcher(Constraint.json_schema(schema), "t")
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        g.matcher(Constraint.json_schema(schema), "t")
        out[name] = {"cold_ms": cold * 1e3, "cached_ms": (time.perf_counter() - t0) * 1e3}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(ROOT / "models" / "kvfence-tiny"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    engine = Engine(
        EngineConfig(
            model=args.model,
            kv_pool_tokens=args.batch * (args.tokens + 64),
            context_length=args.tokens + 64,
            max_running_requests=args.batch,
            threads=args.threads,
            enable_prefix_caching=False,
        )
    )
    fracs = (0.0, 0.5, 1.0)
    rates: dict[float, list[float]] = {f: [] for f in fracs}
    decode_rate(engine, args.batch, 4, 1.0, seed=999)  # warm: kernels, grammar cache
    for r in range(args.rounds):  # interleaved, so load drift hits every fraction alike
        for f in fracs:
            rates[f].append(decode_rate(engine, args.batch, args.tokens, f, seed=r * 1000))
    best = {f: max(v) for f, v in rates.items()}
    result = {
        "command": this_command(),
        "machine": machine(),
        "model": args.model,
        "vocab": engine.model_config.vocab_size,
        "batch": args.batch,
        "tokens": args.tokens,
        "decode_tok_s": {f"{int(f * 100)}%": v for f, v in rates.items()},
        "ratio_vs_free_best": {f"{int(f * 100)}%": best[f] / best[0.0] for f in fracs},
        "compile": compile_times(engine),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    write_json(RESULTS / "structured.json", result)


if __name__ == "__main__":
    main()
