"""The `kvfence` command: serve | router | up | preflight | leakcheck | check-protocol | bench."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvfence.config import (
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    ConfigError,
    EngineConfig,
)
from kvfence.faults import Faults

if TYPE_CHECKING:
    from kvfence.role import RoleService

EXIT_CAPACITY = 2


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig(model="")
    p.add_argument(
        "--model", "--model-path", dest="model", required=True, help="local HF model dir"
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default=d.device, help="cpu | cuda[:N]")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES)
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--kv-pool-tokens", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument(
        "--decode-step-prefill-budget",
        type=int,
        default=None,
        help="prefill tokens per step while requests decode (default: --chunked-prefill-size); "
        "lower trades throughput for a shorter decode stall (p99 ITL)",
    )
    p.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        choices=KERNEL_BACKENDS,
        help="decode attention: native CPU kernel reading pages in place, or torch gather+SDPA",
    )
    p.add_argument(
        "--linear-backend",
        default=d.linear_backend,
        choices=KERNEL_BACKENDS,
        help="projection matmuls: native packed float32 CPU kernel, or torch (MKL / cuBLAS)",
    )
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="CPU threads for the kernels (default: every core; `kvfence up` gives each worker "
        "its share of the cores)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--unsafe-skip-preflight", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--kv-poison-on-free",
        action="store_true",
        help="debug: fill freed KV pages with NaN so any stale read shows up",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        context_length=args.context_length,
        page_size=args.page_size,
        kv_pool_tokens=args.kv_pool_tokens,
        mem_fraction_static=args.mem_fraction_static,
        chunked_prefill_size=args.chunked_prefill_size,
        decode_step_prefill_budget=args.decode_step_prefill_budget,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        max_running_requests=args.max_running_requests,
        threads=args.threads,
        seed=args.seed,
        unsafe_skip_preflight=args.unsafe_skip_preflight,
        kv_poison_on_free=args.kv_poison_on_free,
    )


def add_pd_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disaggregation-mode", default="null", choices=("null", "prefill", "decode"))
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", default="tcp", choices=("tcp", "mooncake"))
    p.add_argument(
        "--cluster-secret-file",
        default=None,
        help="secret shared by all PD workers (or KVFENCE_CLUSTER_SECRET); authenticates transfers",
    )
    p.add_argument(
        "--disaggregation-timeout",
        type=float,
        default=30.0,
        help="seconds a KV transfer may take before it is aborted",
    )


def role_service(args: argparse.Namespace, faults: Faults) -> RoleService:
    """The role the HTTP layer serves: unified, or a PD role, each on its own engine."""
    cfg = engine_config(args)
    if args.disaggregation_mode == "null":
        from kvfence.engine.engine import Engine
        from kvfence.role import UnifiedService

        return UnifiedService(Engine(cfg, faults))
    from kvfence.pd.auth import load_cluster_secret

    secret = load_cluster_secret(args.cluster_secret_file)
    backend = args.disaggregation_transfer_backend
    timeout = args.disaggregation_timeout
    if args.disaggregation_mode == "prefill":
        from kvfence.pd.prefill import PrefillService

        port = args.disaggregation_bootstrap_port
        return PrefillService(cfg, args.host, port, timeout, backend, secret, faults)
    from kvfence.pd.decode import DecodeService

    host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    return DecodeService(cfg, timeout, backend, secret, faults, host)


def _crash(point: str) -> None:
    """A kill_* fault point fired in this test child: die as abruptly as a real crash would
    (SIGKILL: no cleanup, no exit handlers), which is what the peer must survive."""
    os.kill(os.getpid(), signal.SIGKILL)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvfence.engine.engine import CapacityError
    from kvfence.model.config import UnsupportedModelError
    from kvfence.server.api import serve

    try:
        # This process's fault points: none unless a test harness started it with
        # KVFENCE_FAULTS (and fault injection on); a kill_* point then ends the process.
        faults = Faults.from_env(crash=_crash)
        service = role_service(args, faults)
        serve(
            service,
            args.host,
            args.port,
            args.api_key_file,
            log_level=args.log_level,
            faults=faults,
        )
    except CapacityError as e:
        print(f"kvfence: refusing to start: {e}", file=sys.stderr)
        return EXIT_CAPACITY
    except (ConfigError, UnsupportedModelError, ValueError, OSError, RuntimeError) as e:
        print(f"kvfence: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfence", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an OpenAI-compatible server (unified prefill+decode)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key-file", default=None, help="lines of `key tenant`; enables auth")
    s.add_argument("--log-level", default="info")
    add_pd_args(s)
    sub.add_parser(
        "preflight", help="check a node's KV pool against its context length", add_help=False
    )
    sub.add_parser("router", help="OpenAI entry point in front of prefill/decode", add_help=False)
    sub.add_parser("up", help="router + N prefill + M decode workers here", add_help=False)
    sub.add_parser("bench", help="load-test any OpenAI-compatible server", add_help=False)
    sub.add_parser(
        "check-protocol", help="model-check the KV transfer protocol (formal/)", add_help=False
    )
    sub.add_parser(
        "leakcheck", help="check any OpenAI endpoint's answers for other requests' KV",
        add_help=False,
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    # These load their own modules only when asked, so `serve` stays light.
    if argv[:1] == ["preflight"]:
        from kvfence.tools.preflight import main as preflight_main

        return preflight_main(argv[1:])
    if argv[:1] == ["router"]:
        from kvfence.server.router import main as router_main

        return router_main(argv[1:])
    if argv[:1] == ["up"]:
        from kvfence.tools.up import main as up_main

        return up_main(argv[1:])
    if argv[:1] == ["bench"]:
        from kvfence.tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["check-protocol"]:
        from kvfence.tools.check_protocol import main as check_protocol_main

        return check_protocol_main(argv[1:])
    if argv[:1] == ["leakcheck"]:
        from kvfence.tools.leakcheck import main as leakcheck_main

        return leakcheck_main(argv[1:])
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.cmd == "serve":
        return cmd_serve(args)
    parser.error(f"unknown command {args.cmd}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
