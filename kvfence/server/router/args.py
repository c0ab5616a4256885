"""The router's settings (timeouts, body limit, routing policy) with their defaults, and its
command-line flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvfence.args.engine import SHARED_PREFIX_FILE
from kvfence.args.option import add_options
from kvfence.args.routing import ROUTING_OPTIONS
from kvfence.args.server import SERVER_OPTIONS
from kvfence.config import RoutingConfig

DEFAULT_HEALTH_INTERVAL_S = 2.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # the workers' own limit: larger bodies would die there
DEFAULT_GRACEFUL_SHUTDOWN_S = 5.0


@dataclass(frozen=True)
class RouterSettings:
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    routing: RoutingConfig = RoutingConfig()
    # --shared-prefix-file's items, as written (texts, token-id lists): the workers' public
    # prefixes, which the prefix index predicts from every tenant's traffic.
    shared_prefixes: tuple[str | tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("health_interval", "health_timeout", "request_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill worker URL(s), e.g. http://127.0.0.1:30001",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="decode worker URL(s)",
    )
    add_options(p, SERVER_OPTIONS)
    p.add_argument(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL_S,
        help="seconds between worker health polls",
    )
    p.add_argument("--health-timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT_S)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a whole request (stream included) may take",
    )
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S)
    add_options(p.add_argument_group("routing policy"), ROUTING_OPTIONS)
    add_options(
        p,
        (SHARED_PREFIX_FILE,),
        shared_prefix_file={"help": "the workers' --shared-prefix-file (the same file): its "
                            "prefixes are predicted from every tenant's requests"},
    )
