"""An ordered, framed, authenticated, bidirectional connection over TCP (asyncio streams).

One writer lock keeps frames whole and in order, which the protocol relies on: an ABORT_ACK or
DONE sent after a room's last page also arrives after it. Every frame carries a sequence number
and a MAC under the connection's current key (pd/auth.py); a bad one raises WireError.
"""

from __future__ import annotations

import asyncio
import socket

from kvfence import faults
from kvfence.pd import auth, wire


class Connection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._lock = asyncio.Lock()
        self.closed = False
        self.secret = secret
        self._key = auth.hello_key(secret)
        self._seq_out = 0
        self._seq_in = 0
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.peer = writer.get_extra_info("peername")

    @classmethod
    async def open(cls, host: str, port: int, timeout: float, secret: bytes) -> Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=1 << 20), timeout
        )
        return cls(reader, writer, secret)

    def start_session(self, client_nonce: str, server_nonce: str) -> None:
        """Switch both directions to the session key once HELLO/HELLO_OK are exchanged."""
        self._key = auth.session_key(self.secret, client_nonce, server_nonce)
        self._seq_out = self._seq_in = 0

    async def send(self, msg: wire.Frame, payload: bytes | memoryview = b"") -> None:
        if self.closed:
            raise ConnectionError("connection closed")
        async with self._lock:
            self._seq_out += 1
            self.writer.writelines(wire.encode(msg, payload, self._seq_out, self._key))
            await self.writer.drain()

    async def recv(self) -> tuple[wire.Frame, bytes]:
        """The next authentic frame; ConnectionError at EOF, wire.WireError on a frame that is
        malformed, forged (bad MAC), replayed or reordered (bad sequence number)."""
        try:
            prefix = await self.reader.readexactly(wire.PREFIX_SIZE)
            header_len, payload_len, seq = wire.parse_prefix(prefix)
            tag = await self.reader.readexactly(wire.MAC_SIZE)
            header = await self.reader.readexactly(header_len)
            payload = await self.reader.readexactly(payload_len) if payload_len else b""
        except asyncio.IncompleteReadError as e:
            raise ConnectionError("peer closed the connection") from e
        if not faults.active("skip_mac"):
            if not auth.verify(auth.mac(self._key, prefix, header, payload), tag):
                raise wire.WireError("bad MAC: forged, corrupted or from another connection")
            if seq != self._seq_in + 1:
                raise wire.WireError(f"sequence {seq} after {self._seq_in}: replayed or reordered")
        self._seq_in = seq
        return wire.decode_header(header), payload

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()
