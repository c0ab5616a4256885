"""An ordered, framed, authenticated, bidirectional connection over a TCP socket (asyncio).

One writer lock keeps frames whole and in order, which the protocol relies on: an ABORT_ACK or
DONE sent after a room's last page also arrives after it. Every frame carries a sequence number
and a MAC under the connection's current key for its direction (pd/auth.py); a bad one raises
WireError.

The socket is driven directly (non-blocking recv_into / sendmsg) rather than through asyncio
streams: a payload is received straight into a reused buffer and sent from the caller's memory,
with no intermediate copies (streams copy a large frame three times on the way in and join it
once on the way out).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from kvfence.faults import Faults
from kvfence.pd import auth, wire

_STAGE = 64 << 10  # small reads (prefixes, headers) go through a staging buffer of this size
# While a big payload is due, the socket reports readable only once this much of it is queued
# (SO_RCVLOWAT): a frame of MiBs then costs a few loop wake-ups instead of one per segment burst.
_LOWAT = 256 << 10
_SPARES = 4  # payload buffers a connection keeps for reuse
_IOV_MAX = 1024  # buffers per sendmsg (Linux's UIO_MAXIOV)


class Connection:
    def __init__(
        self, sock: socket.socket, secret: bytes, client: bool, faults: Faults | None = None
    ) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # tests also use socketpairs
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self.closed = False
        self.secret = secret
        self.client = client  # decode dials, prefill accepts: it picks each direction's key
        self._faults = faults if faults is not None else Faults()
        hello = auth.HelloMac(auth.hello_key(secret))
        self._mac_out: auth.FrameMac = hello
        self._mac_in: auth.FrameMac = hello
        self._seq_out = 0
        self._seq_in = 0
        self._stage = bytearray(_STAGE)
        self._lo = self._hi = 0
        self._spares: list[bytearray] = []  # payload buffers, reused once handed back
        self._lent: bytearray | None = None
        self._lowat = 1
        self._waiters: set[asyncio.Future] = set()
        try:
            self.peer = sock.getpeername()
        except OSError:
            self.peer = None

    @classmethod
    async def open(
        cls, host: str, port: int, timeout: float, secret: bytes, faults: Faults | None = None
    ) -> Connection:
        loop = asyncio.get_running_loop()

        async def dial() -> socket.socket:
            err: OSError | None = None
            for family, kind, proto, _, addr in await loop.getaddrinfo(
                host, port, type=socket.SOCK_STREAM
            ):
                sock = socket.socket(family, kind, proto)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, addr)
                    return sock
                except OSError as e:
                    sock.close()
                    err = e
            raise err or OSError(f"cannot resolve {host}")

        return cls(await asyncio.wait_for(dial(), timeout), secret, client=True, faults=faults)

    def start_session(self, client_nonce: str, server_nonce: str) -> None:
        """Switch both directions to their session keys once HELLO/HELLO_OK are exchanged."""
        c2s, s2c = auth.session_keys(self.secret, client_nonce, server_nonce)
        out, inn = (c2s, s2c) if self.client else (s2c, c2s)
        self._mac_out, self._mac_in = auth.SessionMac(out), auth.SessionMac(inn)
        self._seq_out = self._seq_in = 0

    # ---- sending ------------------------------------------------------------------------------

    async def send(self, msg: wire.Frame, payload: wire.Payload = b"") -> None:
        """Send one frame; the payload is read from the caller's memory until this returns."""
        if self.closed:
            raise ConnectionError("connection closed")
        async with self._lock:
            self._seq_out += 1
            bufs = wire.encode(msg, payload, self._seq_out, self._mac_out)
            i = 0
            while i < len(bufs):
                if self.closed:
                    raise ConnectionError("connection closed")
                try:
                    sent = self.sock.sendmsg(bufs[i : i + _IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    await self._ready(self._loop.add_writer, self._loop.remove_writer)
                    continue
                except OSError as e:
                    raise ConnectionError(f"send failed: {e}") from e
                while i < len(bufs) and sent >= bufs[i].nbytes:
                    sent -= bufs[i].nbytes
                    i += 1
                if i < len(bufs):
                    bufs[i] = bufs[i][sent:]

    # ---- receiving ----------------------------------------------------------------------------

    async def recv(self) -> tuple[wire.Frame, memoryview]:
        """The next authentic frame; ConnectionError at EOF, wire.WireError on a frame that is
        malformed, forged (bad MAC), replayed or reordered (bad sequence number). The payload
        is a view of a buffer this connection reuses: it is valid until the next recv(), unless
        keep() takes it."""
        if self._lent is not None:
            self.give_back(self._lent)
            self._lent = None
        fixed = bytearray(wire.PREFIX_SIZE + wire.MAC_SIZE)
        await self._read_into(memoryview(fixed))
        prefix, tag = bytes(fixed[: wire.PREFIX_SIZE]), bytes(fixed[wire.PREFIX_SIZE :])
        header_len, payload_len, seq = wire.parse_prefix(prefix)
        if isinstance(self._mac_in, auth.HelloMac) and (
            payload_len or header_len > wire.MAX_HELLO_HEADER
        ):
            # Nothing is authenticated yet: allocate no more than a hello needs.
            raise wire.WireError(f"hello frame too large ({header_len}, {payload_len})")
        header = bytearray(header_len)
        await self._read_into(memoryview(header))
        payload = memoryview(b"")
        if payload_len:
            fits = [b for b in self._spares if len(b) >= payload_len]
            if fits:
                buf = fits[0]
                self._spares.remove(buf)
            else:
                buf = bytearray(payload_len)
            self._lent = buf
            payload = memoryview(buf)[:payload_len]
            await self._read_into(payload)
        if self._faults.guards().on("mac"):
            expected = self._mac_in.tag(seq, prefix, header, payload)
            if not auth.verify(expected, tag):
                raise wire.WireError("bad MAC: forged, corrupted or from another connection")
            if seq != self._seq_in + 1:
                raise wire.WireError(f"sequence {seq} after {self._seq_in}: replayed or reordered")
        self._seq_in = seq
        return wire.decode_header(bytes(header)), payload

    def keep(self) -> bytearray | None:
        """Take the last payload's buffer: it stays valid until give_back(buf), across recv()s
        (the receiver applies a frame off the loop while the next one arrives)."""
        buf, self._lent = self._lent, None
        return buf

    def give_back(self, buf: bytearray) -> None:
        if len(self._spares) < _SPARES:
            self._spares.append(buf)

    async def _read_into(self, dst: memoryview) -> None:
        got = min(self._hi - self._lo, dst.nbytes)
        dst[:got] = self._stage[self._lo : self._lo + got]
        self._lo += got
        while got < dst.nbytes:
            if dst.nbytes - got >= _STAGE:  # big: straight into its destination
                got += await self._recv_into(dst[got:], dst.nbytes - got)
                continue
            n = await self._recv_into(memoryview(self._stage), dst.nbytes - got)
            take = min(n, dst.nbytes - got)
            dst[got : got + take] = self._stage[:take]
            self._lo, self._hi = take, n
            got += take

    async def _recv_into(self, buf: memoryview, need: int) -> int:
        """Some bytes into buf; `need` (what the frame being read still owes) is how many to
        wait for before the loop wakes this reader again."""
        while True:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                n = self.sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                self._set_lowat(min(need, _LOWAT))
                await self._ready(self._loop.add_reader, self._loop.remove_reader)
                continue
            except OSError as e:
                raise ConnectionError(f"receive failed: {e}") from e
            if n == 0:
                raise ConnectionError("peer closed the connection")
            return n

    def _set_lowat(self, n: int) -> None:
        if n != self._lowat and self.sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, n)
            except OSError:
                return  # an optimisation only
            self._lowat = n

    async def _ready(
        self, add: Callable[..., None], remove: Callable[[int], Awaitable[bool] | bool]
    ) -> None:
        """Wait until the socket is readable / writable (or the connection is closed)."""
        fut = self._loop.create_future()
        add(self._fd, lambda: fut.done() or fut.set_result(None))
        self._waiters.add(fut)
        try:
            await fut
        finally:
            self._waiters.discard(fut)
            if not self.closed:  # close() unregistered it; the fd number may be reused since
                remove(self._fd)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self._fd)
            self._loop.remove_writer(self._fd)
            for fut in self._waiters:
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))
            self.sock.close()


class Listener:
    """Accepts connections on host:port and runs handler(conn) for each."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Connection], Awaitable[None]],
        secret: bytes,
        faults: Faults | None = None,
    ) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        self._handler = handler
        self._secret = secret
        self._faults = faults
        self._task = asyncio.ensure_future(self._accept())

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        handler: Callable[[Connection], Awaitable[None]],
        secret: bytes,
        faults: Faults | None = None,
    ) -> Listener:
        sock = socket.create_server((host or "0.0.0.0", port), backlog=128)
        sock.setblocking(False)
        return cls(sock, handler, secret, faults)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.sock)
            conn = Connection(sock, self._secret, client=False, faults=self._faults)
            asyncio.ensure_future(self._handler(conn))

    def close(self) -> None:
        self._task.cancel()
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
