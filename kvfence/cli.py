"""The `kvfence` command: serve | router | up | certs | preflight | leakcheck | check-protocol |
bench."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Sequence

from kvfence.args.node import NODE_OPTIONS
from kvfence.args.option import add_options
from kvfence.config import NodeConfig
from kvfence.faults import Faults
from kvfence.lifetime import die_with_parent_from_env
from kvfence.node import build_role, startup_error


def _crash(point: str) -> None:
    """A kill_* fault point fired in this test child: die as abruptly as a real crash would
    (SIGKILL: no cleanup, no exit handlers), which is what the peer must survive."""
    os.kill(os.getpid(), signal.SIGKILL)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvfence.role_process import RemoteRole, RoleStartFailed, spawn_role
    from kvfence.server.api import serve

    # A worker ended by a fatal signal (a C-level crash: SIGSEGV, SIGBUS, SIGABRT...) leaves its
    # threads' Python stacks on stderr, i.e. in its log; SIGKILL (the OOM killer) leaves only
    # the exit status its parent sees.
    faulthandler.enable()
    remote: RemoteRole | None = None
    try:
        # This process's fault points: none unless a test harness started it with
        # KVFENCE_FAULTS (and fault injection on); a kill_* point then ends the process.
        faults = Faults.from_env(crash=_crash)
        # The node's one config, built once from the flags; the engine process gets it whole.
        config = NodeConfig.from_args(args)
        server = config.server
        if server.engine_process:  # the engine in a process of its own (role_process.py)
            service = remote = spawn_role(config)
        else:
            service = build_role(config, faults)
        serve(
            service,
            server.host,
            server.port,
            server.api_key_file,
            log_level=server.log_level,
            faults=faults,
            drain_timeout=server.drain_timeout,
            tool_call_parser=server.tool_call_parser,
            max_tool_calls=server.max_tool_calls,
            admin_api_key_file=server.admin_api_key_file,
        )
    except RoleStartFailed as e:
        return e.code  # the engine process said why
    except Exception as e:
        code = startup_error(e)
        if code is None:
            raise
        return code
    finally:
        if remote is not None:  # serve() may have failed before it started the role
            remote.shutdown()  # idempotent
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `kvfence` parser; `serve` takes the engine, listener and PD options of kvfence/args/."""
    parser = argparse.ArgumentParser(prog="kvfence", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run an OpenAI-compatible server (unified prefill+decode)")
    add_options(s, NODE_OPTIONS)  # one option per NodeConfig field
    sub.add_parser(
        "preflight", help="check a node's KV pool against its context length", add_help=False
    )
    sub.add_parser("router", help="OpenAI entry point in front of prefill/decode", add_help=False)
    sub.add_parser("up", help="router + N prefill + M decode workers here", add_help=False)
    sub.add_parser("bench", help="load-test any OpenAI-compatible server", add_help=False)
    sub.add_parser(
        "certs", help="make a cluster CA and PD workers' TLS certificates", add_help=False
    )
    sub.add_parser(
        "check-protocol", help="model-check the KV transfer protocol (formal/)", add_help=False
    )
    sub.add_parser(
        "leakcheck",
        help="check any OpenAI endpoint's answers for other requests' KV",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent_from_env()  # a child of `kvfence up` goes with it, even when it is SIGKILLed
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
    if argv[:1] == ["certs"]:
        from kvfence.pd.certs import main as certs_main

        return certs_main(argv[1:])
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
