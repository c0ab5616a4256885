"""An ordered, framed, bidirectional connection over TCP (asyncio streams).

One writer lock keeps frames whole and in order, which the protocol relies on: an ABORT_ACK or
DONE sent after a room's last page also arrives after it.
"""

from __future__ import annotations

import asyncio
import socket

from kvfence.pd import wire


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._lock = asyncio.Lock()
        self.closed = False
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.peer = writer.get_extra_info("peername")

    @classmethod
    async def open(cls, host: str, port: int, timeout: float) -> Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 20), timeout
        )
        return cls(reader, writer)

    async def send(self, msg: wire.Frame, payload: bytes | memoryview = b"") -> None:
        if self.closed:
            raise ConnectionError("connection closed")
        async with self._lock:
            self.writer.writelines(wire.encode(msg, payload))
            await self.writer.drain()

    async def recv(self) -> tuple[wire.Frame, bytes]:
        """The next frame; raises ConnectionError at EOF and wire.WireError on garbage."""
        try:
            prefix = await self.reader.readexactly(wire.PREFIX_SIZE)
            header_len, payload_len = wire.parse_prefix(prefix)
            header = await self.reader.readexactly(header_len)
            payload = await self.reader.readexactly(payload_len) if payload_len else b""
        except asyncio.IncompleteReadError as e:
            raise ConnectionError("peer closed the connection") from e
        return wire.decode_header(header), payload

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()
