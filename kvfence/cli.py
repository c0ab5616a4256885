"""The `kvfence` command: serve | router | up | preflight | leakcheck | check-protocol | bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvfence.args import ENGINE_OPTIONS, PD_OPTIONS, SERVER_OPTIONS, add_options
from kvfence.config import ConfigError, EngineConfig

EXIT_CAPACITY = 2


def role_service(engine: Any, args: argparse.Namespace) -> Any:
    """The object the HTTP layer serves: the engine itself, or its PD role wrapping it."""
    if args.disaggregation_mode == "null":
        return engine
    from kvfence.pd.auth import load_cluster_secret
    from kvfence.pd.pairing import model_fingerprint, node_info

    secret = load_cluster_secret(args.cluster_secret_file)
    backend = args.disaggregation_transfer_backend
    mooncake = None
    if backend == "mooncake":
        from kvfence.pd.transport.mooncake import MooncakeEndpoint

        host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
        mooncake = MooncakeEndpoint(engine.pool, hostname=host)
    info = node_info(engine, args.disaggregation_mode, model_fingerprint(args.model), backend)
    if args.unsafe_skip_preflight:
        info["unsafe_skip_capacity"] = True
    timeout = args.disaggregation_timeout
    if args.disaggregation_mode == "prefill":
        from kvfence.pd.prefill import PrefillService

        port = args.disaggregation_bootstrap_port
        return PrefillService(
            engine, info, args.host, port, timeout, mooncake=mooncake, secret=secret
        )
    from kvfence.pd.decode import DecodeService

    return DecodeService(engine, info, timeout, mooncake=mooncake, secret=secret)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvfence.engine.engine import CapacityError, Engine
    from kvfence.model.config import UnsupportedModelError
    from kvfence.server.api import serve

    try:
        service = role_service(Engine(EngineConfig.from_args(args)), args)
        serve(service, args.host, args.port, args.api_key_file, log_level=args.log_level)
    except CapacityError as e:
        print(f"kvfence: refusing to start: {e}", file=sys.stderr)
        return EXIT_CAPACITY
    except (ConfigError, UnsupportedModelError, ValueError, OSError, RuntimeError) as e:
        print(f"kvfence: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `kvfence` parser; `serve` takes the engine, listener and PD options of kvfence.args."""
    parser = argparse.ArgumentParser(prog="kvfence", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an OpenAI-compatible server (unified prefill+decode)")
    add_options(s, ENGINE_OPTIONS)
    add_options(s, SERVER_OPTIONS)
    add_options(s, PD_OPTIONS)
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
    if os.environ.get("KVFENCE_FAULTS"):
        from kvfence import faults

        faults.arm_from_env()  # refuses unless KVFENCE_FAULT_INJECTION=1 too
    if args.cmd == "serve":
        return cmd_serve(args)
    parser.error(f"unknown command {args.cmd}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
