"""What `kvfence up` runs, as one frozen UpConfig built once from its flags, and the command lines
of its workers and router, written from each one's NodeConfig / RoutingConfig (kvfence/args/), so
no flag is missed and none is spelled twice."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfence.args.engine import ENGINE_OPTIONS, SHARED_PREFIX_FILE
from kvfence.args.node import NODE_OPTIONS, node_argv, node_values
from kvfence.args.option import add_options, command_line
from kvfence.args.pd import BOOTSTRAP_PORT, TLS_FILE_OPTIONS, TRANSFER_OPTIONS
from kvfence.args.routing import ROUTING_OPTIONS
from kvfence.args.server import (
    ADMIN_API_KEY_FILE,
    API_KEY_FILE,
    DRAIN_TIMEOUT,
    HOST,
    LOG_LEVEL,
    MAX_TOOL_CALLS,
    PORT,
    SERVER_OPTIONS,
    TOOL_CALL_PARSER,
)
from kvfence.config import NodeConfig, RoutingConfig
from kvfence.pd.certs import TlsFiles

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "models" / "kvfence-tiny"
DEFAULT_STARTUP_TIMEOUT_S = 300.0
DEFAULT_SHUTDOWN_GRACE_S = 10.0


def add_up_args(p: argparse.ArgumentParser) -> None:
    # The workers' own options (kvfence/args/), so `up` takes every flag `serve` does.
    add_options(
        p,
        ENGINE_OPTIONS,
        model={
            # The demo runs the bundled model unless told otherwise.
            "required": False,
            "default": str(BUNDLED_MODEL),
            "help": f"local HF model dir (default: the bundled {BUNDLED_MODEL.name})",
        },
    )
    p.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    add_options(
        p,
        SERVER_OPTIONS,
        host={"help": "the router's address (clients use it)"},
        port={"help": "the router's port"},
        api_key_file={"help": "lines of `key tenant`; given to the router and every worker"},
    )
    p.add_argument(
        "--worker-host",
        default="127.0.0.1",
        help="address the workers bind (HTTP and bootstrap); keep it private",
    )
    # The decodes answer the chat requests the router relays; every worker gets it, so any
    # worker's own API reads tool calls as the cluster's does.
    add_options(p, (TOOL_CALL_PARSER, MAX_TOOL_CALLS))
    # Certificates are not among them: up makes a cluster CA and one certificate per worker.
    add_options(p, TRANSFER_OPTIONS)
    # The router's policy, as `kvfence router` takes it (--router-policy etc. read better here).
    add_options(p.add_argument_group("the router's routing policy"), ROUTING_OPTIONS)
    p.add_argument(
        "--prefill-kv-pool-tokens",
        type=int,
        default=None,
        help="KV pool of the prefill workers (default: --kv-pool-tokens)",
    )
    p.add_argument(
        "--decode-kv-pool-tokens",
        type=int,
        default=None,
        help="KV pool of the decode workers (default: --kv-pool-tokens)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help="seconds to wait for every worker and the router to be healthy",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=DEFAULT_SHUTDOWN_GRACE_S,
        help="seconds each stage of shutdown gets, after --drain-timeout, before SIGKILL",
    )
    # Tests swap the real processes for fakes; not a user-facing knob.
    p.add_argument("--worker-cmd-prefix", default=None, help=argparse.SUPPRESS)
    p.add_argument("--router-cmd-prefix", default=None, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class UpConfig:
    """`kvfence up`'s settings. `node` is what every worker shares (its server's host and port
    are the router's listener; each worker gets its own, its role and its certificate)."""

    node: NodeConfig
    routing: RoutingConfig
    prefill: int = 1
    decode: int = 1
    worker_host: str = "127.0.0.1"
    prefill_kv_pool_tokens: int | None = None  # a per-role pool replaces --kv-pool-tokens
    decode_kv_pool_tokens: int | None = None
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT_S
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE_S
    worker_cmd_prefix: str | None = None
    router_cmd_prefix: str | None = None

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):  # every worker's config is valid before one starts
            self.worker(role)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> UpConfig:
        """From flags parsed with add_up_args (raises ConfigError on a value that cannot work)."""
        own = [f.name for f in dataclasses.fields(cls)][2:]
        return cls(
            NodeConfig.from_args(args),
            RoutingConfig.from_args(args),
            **{name: getattr(args, name) for name in own},
        )

    def with_server(self, **server: object) -> UpConfig:
        """This config with the workers' server settings changed (resolved paths, a key file)."""
        cfg = dataclasses.replace(self.node.server, **server)  # type: ignore[arg-type]
        return dataclasses.replace(self, node=dataclasses.replace(self.node, server=cfg))

    def with_engine(self, **engine: object) -> UpConfig:
        cfg = dataclasses.replace(self.node.engine, **engine)  # type: ignore[arg-type]
        return dataclasses.replace(self, node=dataclasses.replace(self.node, engine=cfg))

    def with_pd(self, **pd: object) -> UpConfig:
        cfg = dataclasses.replace(self.node.pd, **pd)  # type: ignore[arg-type]
        return dataclasses.replace(self, node=dataclasses.replace(self.node, pd=cfg))

    def worker(
        self,
        role: str,
        port: int | None = None,
        bootstrap_port: int | None = None,
        tls: TlsFiles | None = None,
    ) -> NodeConfig:
        """The NodeConfig of one worker of `role` (its own listener, bootstrap port and
        certificate when given; the role's pool when one is set)."""
        node = self.node
        server = dataclasses.replace(node.server, host=self.worker_host, engine_process=False)
        if port is not None:
            server = dataclasses.replace(server, port=port)
        pd = dataclasses.replace(node.pd, disaggregation_mode=role)
        if bootstrap_port is not None:
            pd = dataclasses.replace(pd, disaggregation_bootstrap_port=bootstrap_port)
        if tls is not None:
            pd = dataclasses.replace(pd, tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca)
        engine = node.engine
        role_pool = getattr(self, f"{role}_kv_pool_tokens")
        if role_pool is not None:
            engine = dataclasses.replace(engine, kv_pool_tokens=role_pool)
        return NodeConfig(engine, server, pd)


# A worker's listener, bootstrap port and certificate: worker_command sets them, not worker_args.
_PER_WORKER = (HOST, PORT, BOOTSTRAP_PORT, *TLS_FILE_OPTIONS)


def worker_args(up: UpConfig, role: str) -> list[str]:
    """Every flag a worker of `role` gets besides its listener and certificate, written from its
    NodeConfig with the option specs the worker parses, so none is missed; a value at its
    default is left out."""
    return node_argv(up.worker(role), [o for o in NODE_OPTIONS if o not in _PER_WORKER])


def _prefix(given: str | None, default: list[str]) -> list[str]:
    return shlex.split(given) if given else default


def worker_command(
    up: UpConfig,
    role: str,
    port: int,
    bootstrap_port: int | None = None,
    tls: TlsFiles | None = None,
) -> list[str]:
    """tls: the worker's own certificate files (I8), when it has some."""
    cmd = _prefix(up.worker_cmd_prefix, [sys.executable, "-m", "kvfence.cli", "serve"])
    node = up.worker(role, port, bootstrap_port, tls)
    cmd += HOST.argv(node.server.host) + PORT.argv(port)
    if bootstrap_port is not None:
        cmd += BOOTSTRAP_PORT.argv(bootstrap_port)
    return cmd + node_argv(node, TLS_FILE_OPTIONS) + worker_args(up, role)


def router_command(
    up: UpConfig, prefill_urls: Sequence[str], decode_urls: Sequence[str]
) -> list[str]:
    cmd = _prefix(up.router_cmd_prefix, [sys.executable, "-m", "kvfence.cli", "router"])
    cmd += ["--prefill", *prefill_urls, "--decode", *decode_urls]
    server = up.node.server
    cmd += HOST.argv(server.host) + PORT.argv(server.port)
    values = argparse.Namespace(
        **vars(node_values(up.node)),
        **{f.name: getattr(up.routing, f.name) for f in dataclasses.fields(up.routing)},
    )
    return cmd + command_line(
        values,
        (API_KEY_FILE, LOG_LEVEL, DRAIN_TIMEOUT, *ROUTING_OPTIONS, ADMIN_API_KEY_FILE,
         SHARED_PREFIX_FILE),  # the workers' public prefixes: the router predicts them too
    )  # fmt: skip
