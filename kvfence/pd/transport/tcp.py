"""An ordered, framed, bidirectional connection over TLS 1.3 with mutual certificates (I8,
pd/tls.py), driven on asyncio; and the bootstrap Listener that accepts them.

TLS runs on memory BIOs (ssl.SSLObject) over a raw non-blocking socket, not on an SSLSocket:
- receiving, one recv_into of up to _RX bytes per wake-up feeds the incoming BIO, and the
  payload is then decrypted view by view (memory the receiver names: a Placement, e.g.
  decode's pool pages) with no system call between records. An SSLSocket pays a recv system
  call, and the kernel's TCP bookkeeping behind it, per 16 KiB record: on the KV transfer that
  cost more than the BIO's extra copy (benchmarks/RESULTS.md "KV transfer");
- sending, the frame is encrypted into the outgoing BIO and flushed with one send per _FLUSH
  bytes (a few records).
The GIL is released inside SSL_read / SSL_write.

One writer lock keeps frames whole and in order, which the protocol relies on: an ABORT_ACK or
DONE sent after a room's last page also arrives after it. Integrity, order, replay and secrecy
are TLS's; the frames themselves are strictly bounded and decoded (pd/wire.py).

Before a peer has proved its certificate, the Listener bounds what it may hold: at most
max_pending connections in their handshake at once (more are closed on accept), each for at most
handshake_timeout seconds, and nothing allocated for it but the handshake's read buffer
(_HANDSHAKE_READ) and OpenSSL's own buffers.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from kvfence.faults import Faults
from kvfence.pd import wire
from kvfence.pd.tls import TlsConfig

_RX = 256 << 10  # the most one recv_into takes from the socket for the incoming BIO
_HANDSHAKE_READ = 16 << 10  # the same, before the peer has proved its certificate
_SCRATCH = 64 << 10  # where a dropped payload is decrypted to
# Encrypted bytes gathered in the outgoing BIO per send system call: small enough that the
# receiver starts decrypting while the rest is encrypted (benchmarks/tls_connection.py, 10
# repeats each, after/before SSLSocket: 16 KiB 1.10, 32 KiB 1.22, 64 KiB 1.18, 256 KiB 0.95).
_FLUSH = 32 << 10
# While a big payload is due, the socket reports readable only once this much of it is queued
# (SO_RCVLOWAT): a frame of MiBs then costs a few loop wake-ups instead of one per segment burst.
_LOWAT = 256 << 10
# OpenSSL may already hold a partial record of what is due (at most one record's ciphertext,
# in the BIO or its own buffer): the mark stays that far below the plaintext still owed, so it
# never waits for bytes that will not come.
_RECORD_SLACK = (16 << 10) + 256
_SPARES = 4  # payload buffers a connection keeps for reuse
# Pieces smaller than a TLS record are copied together before encryption: one small SSL_write
# per piece would cost a record each.
_COALESCE = 16 << 10
_BATCH = 256 << 10

_BLOCKED = (BlockingIOError, InterruptedError)

PeerKey = tuple[str, int]  # a resolved address: (ip, port)


@dataclass
class Placement:
    """Where a frame's payload goes instead of a connection buffer: `views` of the receiver's
    memory, filled in order (their sizes sum to the payload's). valid() is asked before the
    first read and after every wait for the socket (the only points where anything else runs
    on the loop): once it says False, the rest of the payload is read and dropped, so nothing
    that ran meanwhile (a room released) is written over afterwards. landed[i](views[i]) once
    view i is full (while still valid), e.g. a hash's update while the bytes are in cache (a
    bound C method: it is called for every view of a transfer)."""

    views: list[memoryview]
    valid: Callable[[], bool]
    landed: Sequence[Callable[[memoryview], object]] | None = None
    dropped: bool = False  # valid() said False: the views did not get the whole payload

    def writable(self) -> bool:
        if not self.dropped and not self.valid():
            self.dropped = True
        return not self.dropped


class RecordError(ConnectionError):
    """A TLS record that does not authenticate inside an established session: forged, replayed,
    reordered or from another connection. The connection is dropped; nothing it carried counts."""


@dataclass(frozen=True)
class LinkLimits:
    """Bounds on PD connections (flags: --tls-handshake-timeout, --max-pending-handshakes,
    --pd-idle-timeout)."""

    handshake_timeout_s: float = 10.0  # an unauthenticated peer's whole TLS handshake
    max_pending_handshakes: int = 64  # per listener, at once
    idle_timeout_s: float = 300.0  # decode closes a prefill connection idle this long

    def __post_init__(self) -> None:
        if not (self.handshake_timeout_s > 0 and self.idle_timeout_s > 0):
            raise ValueError("PD timeouts must be positive")
        if self.max_pending_handshakes < 1:
            raise ValueError("--max-pending-handshakes must be at least 1")


async def resolve(addr: str) -> PeerKey:
    """host:port (or [v6]:port) as the address it resolves to, the key of one connection: any
    spelling of one address (127.0.0.00001, a name) shares it. ValueError / OSError when it
    does not parse or resolve."""
    host, sep, port_s = addr.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"not host:port: {addr!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, int(port_s), type=socket.SOCK_STREAM
    )
    if not infos:
        raise OSError(f"{host} does not resolve")
    ip, port = infos[0][4][:2]
    return str(ip), int(port)


class Connection:
    """A TLS connection whose handshake (and the peer's role check) has completed."""

    def __init__(
        self,
        sock: socket.socket,
        tls: ssl.SSLObject,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        client: bool,
        faults: Faults | None = None,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock  # the raw socket: TLS is self._tls over the two BIOs
        self._fd = sock.fileno()
        self._tls, self._in, self._out = tls, incoming, outgoing
        self._loop = asyncio.get_running_loop()
        self._lock = asyncio.Lock()
        self.closed = False
        self.client = client  # decode dials, prefill accepts
        self._faults = faults if faults is not None else Faults()
        self._hello = True  # until the first frame (the hello) is in: its size is capped
        self._rx = bytearray(_RX)
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._batch = bytearray(_BATCH)
        self._tx = memoryview(b"")  # ciphertext taken from the outgoing BIO, not yet sent
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
        cls, ip: str, port: int, timeout: float, tls: TlsConfig, faults: Faults | None = None
    ) -> Connection:
        """Dial a resolved prefill address, complete TLS and check its certificate's role."""
        faults = faults if faults is not None else Faults()
        loop = asyncio.get_running_loop()

        async def dial() -> Connection:
            family = socket.AF_INET6 if ":" in ip else socket.AF_INET
            raw = socket.socket(family, socket.SOCK_STREAM)
            raw.setblocking(False)
            try:
                await loop.sock_connect(raw, (ip, port))
                return await _secure(raw, tls, faults, client=True)
            except BaseException:
                raw.close()
                raise

        return await asyncio.wait_for(dial(), timeout)

    # ---- sending ------------------------------------------------------------------------------

    async def send(self, msg: wire.Frame, payload: wire.Payload = b"") -> None:
        """Send one frame; the payload is read from the caller's memory until this returns."""
        if self.closed:
            raise ConnectionError("connection closed")
        async with self._lock:
            for chunk in _batches(wire.encode(msg, payload), self._batch):
                for at in range(0, chunk.nbytes, _FLUSH):
                    self._encrypt(chunk[at : at + _FLUSH])
                    if self._out.pending >= _FLUSH:
                        await self._flush()
            await self._flush()

    def _encrypt(self, view: memoryview) -> None:
        """Encrypt view into the outgoing BIO (which takes all of it: it never blocks)."""
        while view.nbytes:
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                view = view[self._tls.write(view) :]
            except ssl.SSLError as e:
                raise ConnectionError(f"send failed: {e}") from e

    async def _flush(self) -> None:
        """Send everything the outgoing BIO holds (with what an earlier flush left)."""
        while True:
            if not self._tx.nbytes:
                if not self._out.pending:
                    return
                self._tx = memoryview(self._out.read())
            if self.closed:
                raise ConnectionError("connection closed")
            try:
                sent = self.sock.send(self._tx)
            except _BLOCKED:
                await self._ready(self._loop.add_writer, self._loop.remove_writer)
                continue
            except OSError as e:
                raise ConnectionError(f"send failed: {e}") from e
            self._tx = self._tx[sent:]

    # ---- receiving ----------------------------------------------------------------------------

    async def recv(
        self, place: Callable[[wire.Frame, int], Placement | None] | None = None
    ) -> tuple[wire.Frame, memoryview]:
        """The next frame; ConnectionError at EOF or when TLS fails (a forged, replayed or
        reordered record), wire.WireError on a malformed frame. The payload is a view of a
        buffer this connection reuses: it is valid until the next recv(), unless keep() takes
        it. place(frame, payload size), asked once the header is in: a Placement to decrypt
        the payload straight into (the payload returned is then empty), or None."""
        if self._lent is not None:
            self.give_back(self._lent)
            self._lent = None
        fixed = bytearray(wire.PREFIX_SIZE)
        await self._read_into(memoryview(fixed))
        header_len, payload_len = wire.parse_prefix(bytes(fixed))
        if self._hello and (payload_len or header_len > wire.MAX_HELLO_HEADER):
            # The pairing facts are small: a hello claiming more is refused before allocation.
            raise wire.WireError(f"hello frame too large ({header_len}, {payload_len})")
        self._hello = False
        header = bytearray(header_len)
        await self._read_into(memoryview(header))
        frame = wire.decode_header(bytes(header))
        payload = memoryview(b"")
        placement = place(frame, payload_len) if place is not None and payload_len else None
        if placement is not None:
            left = payload_len
            if sum(v.nbytes for v in placement.views) != payload_len:
                raise ValueError("a placement must take the whole payload")
            # The hot loop of a transfer (a view per page block, hundreds per frame): no
            # coroutine per view, and valid() asked only where something else may have run.
            write = placement.writable()
            landed = placement.landed
            for i, view in enumerate(placement.views):
                left -= view.nbytes
                got = self._fill(view, 0, write)
                while got < view.nbytes:
                    await self._wait_readable(view.nbytes - got + left)
                    write = placement.writable()
                    got = self._fill(view, got, write)
                if write and landed is not None:
                    landed[i](view)
        elif payload_len:
            fits = [b for b in self._spares if len(b) >= payload_len]
            if fits:
                buf = fits[0]
                self._spares.remove(buf)
            else:
                buf = bytearray(payload_len)
            self._lent = buf
            payload = memoryview(buf)[:payload_len]
            await self._read_into(payload)
        return frame, payload

    def keep(self) -> bytearray | None:
        """Take the last payload's buffer: it stays valid until give_back(buf), across recv()s
        (the receiver applies a frame off the loop while the next one arrives)."""
        buf, self._lent = self._lent, None
        return buf

    def give_back(self, buf: bytearray) -> None:
        if len(self._spares) < _SPARES:
            self._spares.append(buf)

    async def _read_into(self, dst: memoryview) -> None:
        got = self._fill(dst, 0, True)
        while got < dst.nbytes:
            await self._wait_readable(dst.nbytes - got)
            got = self._fill(dst, got, True)

    def _fill(self, dst: memoryview, got: int, write: bool) -> int:
        """Fill dst from byte `got` on with what can be decrypted without waiting; how far it
        is filled now. write False: the bytes are decrypted and dropped."""
        read, scratch = self._tls.read, self._scratch
        while got < dst.nbytes:
            want = dst.nbytes - got
            try:
                # A record at most per call, from the BIO; the socket only when it runs dry.
                if write:
                    n = read(want, dst[got:])
                else:
                    n = read(min(want, _SCRATCH), scratch)
            except ssl.SSLWantReadError:
                if not self._refill():
                    return got
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError) as e:
                raise ConnectionError("peer closed the connection") from e
            except ssl.SSLError as e:
                raise RecordError(f"bad TLS record: {e}") from e
            if n == 0:
                raise ConnectionError("peer closed the connection")
            got += n
        return got

    def _refill(self) -> bool:
        """Move what the socket holds (up to _RX bytes) into the incoming BIO; False when it
        holds nothing yet."""
        if self.closed:
            raise ConnectionError("connection closed")
        try:
            n = self.sock.recv_into(self._rx)
        except _BLOCKED:
            return False
        except OSError as e:
            raise ConnectionError(f"receive failed: {e}") from e
        if n == 0:
            raise ConnectionError("peer closed the connection")
        self._in.write(memoryview(self._rx)[:n])
        return True

    async def _wait_readable(self, need: int) -> None:
        """Until the socket has bytes; `need` (what the frame being read still owes) is how
        many to wait for before the loop wakes this reader again."""
        self._set_lowat(min(need, _LOWAT) - _RECORD_SLACK)
        await self._ready(self._loop.add_reader, self._loop.remove_reader)

    def _set_lowat(self, n: int) -> None:
        n = max(1, n)
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


def _batches(bufs: list[memoryview], stage: bytearray) -> Iterator[memoryview]:
    """The frame's buffers as writes: big ones as they are, runs of small ones copied together
    into stage (each yielded view must be sent before the next is asked for)."""
    fill = 0
    for b in bufs:
        if b.nbytes >= _COALESCE:
            if fill:
                yield memoryview(stage)[:fill]
                fill = 0
            yield b
            continue
        if fill + b.nbytes > len(stage):
            yield memoryview(stage)[:fill]
            fill = 0
        stage[fill : fill + b.nbytes] = b
        fill += b.nbytes
    if fill:
        yield memoryview(stage)[:fill]


async def _wait_fd(fd: int, write: bool) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (
        loop.add_reader,
        loop.remove_reader,
    )
    add(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        remove(fd)


async def _send_out(raw: socket.socket, out: ssl.MemoryBIO) -> None:
    """Send all the outgoing BIO holds (handshake messages, an alert)."""
    data = memoryview(out.read())
    while data.nbytes:
        try:
            data = data[raw.send(data) :]
        except _BLOCKED:
            await _wait_fd(raw.fileno(), write=True)


async def _secure(
    raw: socket.socket, tls: TlsConfig, faults: Faults, client: bool
) -> Connection:
    """TLS over a connected socket, then the peer's role check; the Connection. Any failure is
    a ConnectionError (the socket is the caller's to close)."""
    guards = faults.guards()
    if raw.family in (socket.AF_INET, socket.AF_INET6):
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    raw.setblocking(False)
    ctx = tls.context(server=not client, verify=guards.on("peer_verify"))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=not client)
    buf = bytearray(_HANDSHAKE_READ)
    try:
        while True:
            try:
                obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await _send_out(raw, outgoing)
            # Bounded: OpenSSL asks for more only once the BIO holds less than a record.
            await _wait_fd(raw.fileno(), write=False)
            try:
                n = raw.recv_into(buf)
            except _BLOCKED:
                continue
            if n == 0:
                raise ConnectionError("peer closed the connection during the TLS handshake")
            incoming.write(memoryview(buf)[:n])
        await _send_out(raw, outgoing)  # the client's Finished; the server's tickets
        tls.check_peer(obj, guards)
    except ConnectionError:  # PeerRejected, or the peer hung up
        raise
    except ssl.SSLError as e:  # an unverifiable certificate, a bad record
        _send_alert(raw, outgoing)
        raise ConnectionError(f"TLS handshake failed: {e}") from e
    except OSError as e:
        raise ConnectionError(f"TLS handshake failed: {e}") from e
    return Connection(raw, obj, incoming, outgoing, client, faults)


def _send_alert(raw: socket.socket, out: ssl.MemoryBIO) -> None:
    """Best effort: the alert OpenSSL wrote for a failed handshake reaches the peer."""
    try:
        raw.send(out.read())
    except OSError:
        pass


class Listener:
    """Accepts connections on host:port, completes TLS and the peer's role check, and runs
    handler(conn) for each. on_refused(reason) counts what did not get that far."""

    def __init__(
        self,
        sock: socket.socket,
        handler: Callable[[Connection], Awaitable[None]],
        tls: TlsConfig,
        faults: Faults | None = None,
        max_pending: int = 64,
        handshake_timeout: float = 10.0,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.sock = sock
        self.port = sock.getsockname()[1]
        self._handler = handler
        self._tls = tls
        self._faults = faults if faults is not None else Faults()
        self.max_pending = max_pending
        self.handshake_timeout = handshake_timeout
        self._on_refused = on_refused or (lambda _reason: None)
        self.pending = 0  # connections accepted whose handshake is still under way
        self._handshakes: set[asyncio.Task] = set()
        self._task = asyncio.ensure_future(self._accept())

    @classmethod
    async def start(
        cls,
        host: str,
        port: int,
        handler: Callable[[Connection], Awaitable[None]],
        tls: TlsConfig,
        faults: Faults | None = None,
        **limits: object,
    ) -> Listener:
        sock = socket.create_server((host or "0.0.0.0", port), backlog=128)
        sock.setblocking(False)
        return cls(sock, handler, tls, faults, **limits)  # type: ignore[arg-type]

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            raw, _ = await loop.sock_accept(self.sock)
            if self.pending >= self.max_pending:
                # Unauthenticated peers hold no more than max_pending handshakes at once.
                raw.close()
                self._on_refused("too_many_handshakes")
                continue
            self.pending += 1
            task = asyncio.ensure_future(self._admit(raw))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _admit(self, raw: socket.socket) -> None:
        try:
            conn = await asyncio.wait_for(
                _secure(raw, self._tls, self._faults, client=False), self.handshake_timeout
            )
        except (ConnectionError, OSError, TimeoutError) as e:
            raw.close()
            self._on_refused("handshake_timeout" if isinstance(e, TimeoutError) else "tls")
            return
        finally:
            self.pending -= 1
        await self._handler(conn)

    def close(self) -> None:
        self._task.cancel()
        for task in list(self._handshakes):
            task.cancel()
        asyncio.get_running_loop().remove_reader(self.sock.fileno())
        self.sock.close()
