"""`kvfence preflight`: size a node's KV pool from config.json and safetensors headers, no server.

Exit 0 when one full-context request fits, 2 when the pool is too small, 1 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from kvfence.args.engine import DEVICE, SIZING_OPTIONS
from kvfence.args.option import add_options
from kvfence.config import DTYPES
from kvfence.kv.sizing import ROLES, PoolPlan, device_memory_bytes, lora_slot_bytes, plan_pool
from kvfence.model.config import ModelConfig, UnsupportedModelError

EXIT_OK = 0
EXIT_BAD_INPUT = 1
EXIT_TOO_SMALL = 2

# fp8 is accepted for planning other deployments; the engine itself stores only the DTYPES.
KV_CACHE_DTYPES = ("auto", *DTYPES, "fp8_e4m3", "fp8_e5m2")


class BadInput(Exception):
    """A flag or model directory preflight cannot plan for; the message is one line."""


class _Parser(argparse.ArgumentParser):
    # argparse exits 2 on a bad flag, which would read as "pool too small".
    def error(self, message: str) -> NoReturn:
        raise BadInput(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvfence preflight",
        description="Check that a node's KV pool holds one full-context request before serving.",
    )
    # Exactly the flags that size a pool in `serve` (kvfence/args/), adapted where planning
    # differs: the dtype defaults to config.json's, fp8 KV can be planned for other engines, and
    # --device is one of two ways to say how much memory there is.
    add_options(
        p,
        [o for o in SIZING_OPTIONS if o is not DEVICE],
        dtype={"default": None, "help": "default: config.json torch_dtype, or float32"},
        kv_cache_dtype={"choices": KV_CACHE_DTYPES},
    )
    where = p.add_mutually_exclusive_group()
    # No default here, or argparse could not tell a given --device from none (the group's check).
    DEVICE.add(where, default=None, help="measure this machine: cpu (MemTotal) or cuda[:N]")
    where.add_argument(
        "--device-memory-gib", type=float, metavar="G", help="plan for a device of G GiB"
    )
    p.add_argument("--role", choices=ROLES, default="unified")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


def run_preflight(args: argparse.Namespace) -> tuple[PoolPlan, int]:
    """Plan the pool for parsed flags; returns the plan and the exit code. Raises BadInput."""
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise BadInput(f"--model {args.model}: not a directory")
    try:
        mc = ModelConfig.from_dir(model_dir)
    except UnsupportedModelError as e:
        raise BadInput(f"--model {args.model}: {e}") from e
    except (KeyError, ValueError, TypeError) as e:
        # A config.json missing a field or holding junk: say which, not a traceback.
        raise BadInput(f"--model {args.model}: config.json unreadable ({e!r})") from e
    dtype = args.dtype or (mc.torch_dtype if mc.torch_dtype in DTYPES else "float32")
    if args.device_memory_gib is not None:
        if args.device_memory_gib <= 0:
            raise BadInput(f"--device-memory-gib {args.device_memory_gib}: must be > 0")
        mem = int(args.device_memory_gib * 2**30)
    else:
        try:
            mem = device_memory_bytes(args.device or DEVICE.default)
        except (RuntimeError, ValueError) as e:
            raise BadInput(str(e)) from e
    try:
        plan = plan_pool(
            mc,
            dtype=dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            page_size=args.page_size,
            context_length=args.context_length,
            kv_pool_tokens=args.kv_pool_tokens,
            mem_fraction_static=args.mem_fraction_static,
            device_memory_bytes=mem,
            tp_size=args.tp_size,
            role=args.role,
            model_dir=model_dir,
            chunked_prefill_size=args.chunked_prefill_size,
            max_running_requests=args.max_running_requests,
            model_name=f"{model_dir.name} ({mc.architecture})",
            lora_bytes=lora_slot_bytes(
                mc, args.enable_lora, args.max_loras, args.max_lora_rank, dtype
            ),
        )
    except (ValueError, KeyError, OSError) as e:
        raise BadInput(str(e)) from e
    return plan, EXIT_OK if plan.fits else EXIT_TOO_SMALL


def format_plan(plan: PoolPlan, memory_from: str) -> str:
    rows = [
        ("model", plan.model),
        ("role", plan.role),
        ("dtype / kv dtype", f"{plan.dtype} / {plan.kv_cache_dtype}"),
        ("tp size", str(plan.tp_size)),
        ("device memory", f"{_gib(plan.device_memory_bytes)} ({memory_from})"),
        ("mem fraction static", str(plan.mem_fraction_static)),
        ("parameters", _params(plan)),
        ("model bytes / rank", f"{_gib(plan.model_bytes)} (from {plan.weights_source})"),
        ("activation reserve", _gib(plan.activation_reserve_bytes)),
        ("LoRA slots", _gib(plan.lora_bytes)),
        ("KV bytes / token / rank", str(plan.kv_bytes_per_token)),
        (
            "KV pool tokens",
            f"{plan.pool_tokens} ({plan.pool_pages} pages x {plan.page_size}, "
            f"from {'--kv-pool-tokens' if plan.pool_source == 'kv_pool_tokens' else 'memory'})",
        ),
        ("context length", str(plan.context_length)),
        ("max full-context requests", str(plan.max_full_context_requests)),
        ("verdict", "OK" if plan.fits else "TOO SMALL"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"warning: {w}" for w in plan.warnings()]
    if not plan.fits:
        lines.append(f"error: {plan.problem()}")
    return "\n".join(lines)


def _params(plan: PoolPlan) -> str:
    total = f"{plan.num_params / 1e9:.2f}B"
    if plan.num_active_params == plan.num_params:
        return total
    return f"{total} total, {plan.num_active_params / 1e9:.2f}B active per token (all resident)"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        plan, code = run_preflight(args)
    except BadInput as e:
        print(f"kvfence preflight: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as e:  # --help
        return int(e.code or 0)
    memory_from = (
        "--device-memory-gib"
        if args.device_memory_gib is not None
        else args.device or DEVICE.default
    )
    if args.json:
        print(json.dumps({**plan.to_dict(), "memory_from": memory_from, "exit_code": code}))
    else:
        print(format_plan(plan, memory_from))
    return code


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


if __name__ == "__main__":
    sys.exit(main())
