"""The transport seam of the PD services: how a room's pages leave prefill (`PageSender`) and
land in decode's pool (`PageReceiver`). Control frames (RESERVE, PageRun headers, DONE, ABORT)
always travel on the tcp `Connection`; what differs per transport is where the page bytes go.
One implementation per transport: `tcp_link.py` (bytes in the PageRun payloads, the receiver
writes them) and `mooncake_link.py` (one-sided writes into decode's registered pool), each
implementing page_link.py's interface; this module picks the one a backend names.
"""

from __future__ import annotations

from kvfence.config import TRANSFER_BACKENDS
from kvfence.pd.kvio import PageTensors
from kvfence.pd.transport.page_link import PageReceiver, PageSender, RoomSend

BACKENDS = TRANSFER_BACKENDS


def page_sender(backend: str, pool: PageTensors, host: str) -> PageSender:
    """host: where this prefill worker is reachable (the mooncake engine binds there)."""
    if backend == "mooncake":
        from kvfence.pd.transport.mooncake_link import MooncakeSender

        return MooncakeSender(pool, host)
    if backend == "tcp":
        from kvfence.pd.transport.tcp_link import TcpSender

        return TcpSender()
    raise ValueError(f"unknown transfer backend {backend!r}: expected one of {BACKENDS}")


def page_receiver(backend: str, pool: PageTensors, host: str) -> PageReceiver:
    """host: where this decode worker is reachable (one-sided writes come there)."""
    if backend == "mooncake":
        from kvfence.pd.transport.mooncake_link import MooncakeReceiver

        return MooncakeReceiver(pool, host)
    if backend == "tcp":
        from kvfence.pd.transport.tcp_link import TcpReceiver

        return TcpReceiver()
    raise ValueError(f"unknown transfer backend {backend!r}: expected one of {BACKENDS}")


__all__ = ["BACKENDS", "PageReceiver", "PageSender", "RoomSend", "page_receiver", "page_sender"]
