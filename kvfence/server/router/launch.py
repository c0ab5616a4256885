"""`kvfence router`: parse the flags, build the app, listen, and print one ready line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from kvfence.config import RoutingConfig
from kvfence.faults import Faults
from kvfence.kv.prefix import read_shared_prefix_file
from kvfence.server.auth import ApiKeyFileError, load_api_keys
from kvfence.server.httpio import ReadyServer, server_config
from kvfence.server.operator import load_operator_key
from kvfence.server.router.app import build_router_app
from kvfence.server.router.args import DEFAULT_GRACEFUL_SHUTDOWN_S, add_router_args
from kvfence.server.router.state import RouterState


def run_router(args: argparse.Namespace) -> int:
    try:
        api_keys = load_api_keys(args.api_key_file) if args.api_key_file else None
        operator_key = load_operator_key(args.admin_api_key_file)
        app = build_router_app(
            args.prefill,
            args.decode,
            api_keys=api_keys,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            request_timeout=args.request_timeout,
            connect_timeout=args.connect_timeout,
            routing=RoutingConfig.from_args(args),
            # None armed unless a test harness started this process with KVFENCE_FAULTS.
            faults=Faults.from_env(),
            operator_key=operator_key,
            shared_prefixes=(
                read_shared_prefix_file(args.shared_prefix_file) if args.shared_prefix_file else ()
            ),
        )
        if operator_key is None:
            raise ValueError(
                "the router reads its workers and signs each decode's prefill address with "
                "the operator key: pass --admin-api-key-file (or set KVFENCE_ADMIN_API_KEY), "
                "the same key its workers have; `kvfence up` makes one"
            )
    except (ApiKeyFileError, ValueError, RuntimeError) as e:
        print(f"kvfence router: {e}", file=sys.stderr)
        return 1
    state: RouterState = app.state.router
    # One line per health poll per worker would drown the request log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))

    def ready(port: int) -> str:
        return (
            f"kvfence router ready: http://{args.host}:{port} "
            f"({len(args.prefill)} prefill, {len(args.decode)} decode; healthy now "
            f"{state.prefill.healthy_count()} prefill, {state.decode.healthy_count()} decode)"
        )

    config = server_config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # On SIGTERM uvicorn stops accepting and lets open relays finish within the drain
        # timeout; closing what is still open then is safe: a closed upstream connection is how
        # a decode learns to abort its transfer with acknowledgement.
        timeout_graceful_shutdown=max(DEFAULT_GRACEFUL_SHUTDOWN_S, args.drain_timeout),
    )
    server = ReadyServer(config, ready)
    server.run()
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfence router", description="OpenAI entry point for prefill/decode workers"
    )
    add_router_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_router(args)
