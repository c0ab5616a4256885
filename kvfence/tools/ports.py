"""Free TCP ports for processes started on this machine (`kvfence up`, tests, benchmarks).

Binding to port 0 hands out a port from the kernel's ephemeral range, which outgoing connections
draw their source ports from too: between picking such a port and the worker binding it, any
client socket on the machine may take it ("address already in use" in a busy test run). So the
pick comes from below that range, where only listeners live, and is checked by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FLOOR = 10_000  # below this, well-known services of the machine


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default; elsewhere the pick still bind-checks


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at `host` now, outside the ephemeral range where one exists."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    if low - _FLOOR >= 1_000:
        for _ in range(200):
            port = random.randrange(_FLOOR, low)
            with socket.socket(family) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(family) as s:  # no room below the range (or all taken): the kernel's pick
        s.bind((host, 0))
        return int(s.getsockname()[1])
