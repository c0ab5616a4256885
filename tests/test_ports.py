"""kvfence.tools.ports: a picked port is bindable and lies outside the kernel's ephemeral range,
so no outgoing connection's source port can take it before the worker binds it."""

from __future__ import annotations

import socket

from kvfence.tools.ports import _ephemeral_low, free_port


def test_a_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert port < low, f"{port} is in the ephemeral range (from {low})"
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if the pick was not free


def test_a_listening_port_is_never_picked() -> None:
    held = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert all(free_port() not in taken for _ in range(200))
    finally:
        for s in held:
            s.close()
