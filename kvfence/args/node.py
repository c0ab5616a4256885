"""A whole node's options, one per NodeConfig field, and a NodeConfig written back as the
`kvfence serve` command line that parses into it (`up`'s workers)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable

from kvfence.args.engine import ENGINE_OPTIONS
from kvfence.args.option import Option, command_line
from kvfence.args.pd import PD_OPTIONS
from kvfence.args.server import ENGINE_PROCESS, MAX_TOOL_CALLS, SERVER_OPTIONS, TOOL_CALL_PARSER
from kvfence.config import NodeConfig

NODE_OPTIONS: tuple[Option, ...] = (
    *ENGINE_OPTIONS,
    *SERVER_OPTIONS,
    TOOL_CALL_PARSER,
    MAX_TOOL_CALLS,
    ENGINE_PROCESS,
    *PD_OPTIONS,
)


def node_values(config: NodeConfig) -> argparse.Namespace:
    """config's fields flat, by option dest (what parsing its command line gives)."""
    parts = (config.engine, config.server, config.pd)
    return argparse.Namespace(
        **{f.name: getattr(p, f.name) for p in parts for f in dataclasses.fields(p)}
    )


def node_argv(config: NodeConfig, options: Iterable[Option] = NODE_OPTIONS) -> list[str]:
    """The `kvfence serve` command line that parses back into config (a value at its default
    is left out, so the child resolves it as the parent would)."""
    return command_line(node_values(config), options)
