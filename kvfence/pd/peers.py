"""The PD services' connections, on the IO loop: decode dials prefills (`Dialer`: one connection
per resolved address, dialled on a room's first need, closed when idle), prefill listens for
decodes (`Bootstrap`). Either way TLS comes first (I8: the peer proves a certificate of its role
before a byte of the connection is read), then HELLO and the pairing check (I7); only then does
a room's frame cross. What a connection's frames do to rooms is the room table's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from kvfence.config import ConfigError, EngineConfig
from kvfence.faults import Faults
from kvfence.pd import wire
from kvfence.pd.pairing import model_fingerprint, node_info, pairing_problem
from kvfence.pd.pool_port import PoolView
from kvfence.pd.stats import TransferStats
from kvfence.pd.tls import TlsConfig
from kvfence.pd.transport.page_link import PageSender
from kvfence.pd.transport.tcp import Connection, LinkLimits, Listener, PeerKey, RecordError
from kvfence.tp_layout import pd_tp_problem

log = logging.getLogger("kvfence.pd.peers")

# What a client sees when its prefill cannot be used: never the resolver's or the socket's words.
UNAVAILABLE = "prefill unavailable"


def check_setup(cfg: EngineConfig, backend: str, tls: TlsConfig | None, role: str) -> TlsConfig:
    """A PD worker's TLS certificate must be of its role (I8), and its tensor-parallel layout one
    the transport can carry; the TLS config."""
    if tls is None or tls.role != role:
        raise ValueError(f"a {role} worker needs its {role} TLS certificate (I8)")
    problem = pd_tp_problem(cfg.tp_size, backend)
    if problem is not None:
        raise ConfigError(problem)
    return tls


def pairing_facts(
    engine: Any, view: PoolView, role: str, cfg: EngineConfig, backend: str
) -> dict[str, Any]:
    """The I7 facts this worker pairs on; HELLO adds what the transport needs."""
    info = node_info(engine, view, role, model_fingerprint(cfg.model), backend)
    if cfg.unsafe_skip_preflight:
        info["unsafe_skip_capacity"] = True
    return info


async def safe_send(conn: Connection, msg: wire.Frame) -> None:
    try:
        await conn.send(msg)
    except ConnectionError:
        pass  # the connection's reader sees the close and fails its rooms


async def send_after(writing: asyncio.Future | None, conn: Connection, msg: wire.Frame) -> None:
    """Send msg once a room's in-flight write (if any) is over: an ABORT_ACK must never overtake
    a write it claims is finished (I4)."""
    if writing is not None:
        try:
            await writing
        except Exception:
            pass
    await safe_send(conn, msg)


@dataclass(frozen=True)
class PeerSetup:
    """What either side's connections are made with: this worker's TLS identity (I8), its
    fault points, the handshake and frame timeouts, the link limits, its pairing facts (I7)
    and the counters."""

    tls: TlsConfig
    faults: Faults
    timeout_s: float
    limits: LinkLimits
    pairing: dict[str, Any]
    stats: TransferStats


class _Unpaired(ConnectionError):
    """The prefill and this decode disagree on a pairing fact (I7)."""


@dataclass
class Peer:
    conn: Connection | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    rooms: set[str] = field(default_factory=set)
    idle_since: float = field(default_factory=time.monotonic)  # when its last room ended


class Dialer:
    """Decode's prefill connections. read(key, peer) is the connection's reader (the room
    table's receiving side); once it returns, lost(rooms) fails the rooms still on it."""

    def __init__(
        self,
        setup: PeerSetup,
        hello: dict[str, Any],
        read: Callable[[PeerKey, Peer], Awaitable[None]],
        lost: Callable[[set[str]], None],
    ) -> None:
        self.tls, self.faults, self.timeout_s = setup.tls, setup.faults, setup.timeout_s
        self.limits, self.pairing, self.stats = setup.limits, setup.pairing, setup.stats
        self.hello = hello  # the pairing facts and what the transport needs
        self._read, self._lost = read, lost
        self.peers: dict[PeerKey, Peer] = {}
        self.pairing_errors: dict[str, str] = {}

    async def peer(self, key: PeerKey) -> Peer:
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer()
            asyncio.ensure_future(self._connect(key, peer))
        await peer.ready.wait()
        return peer

    async def _connect(self, key: PeerKey, peer: Peer) -> None:
        addr = f"{key[0]}:{key[1]}"
        conn: Connection | None = None
        try:
            # TLS first: the peer proves a prefill certificate of the cluster CA in this very
            # connection before the pairing facts, let alone a request, are sent (I8).
            conn = await Connection.open(*key, self.timeout_s, self.tls, self.faults)
            await conn.send(wire.Hello(self.hello))
            msg, _ = await asyncio.wait_for(conn.recv(), self.timeout_s)
            if isinstance(msg, wire.HelloRefused):
                self.stats.inc("pairing_refused")
                self.pairing_errors[addr] = msg.reason
                raise _Unpaired(f"prefill refused to pair: {msg.reason}")
            if not isinstance(msg, wire.HelloOk):
                raise wire.WireError("expected HelloOk")
            problem = pairing_problem(self.pairing, msg.info, self.faults.guards())
            if problem is not None:
                self.stats.inc("pairing_refused")
                self.pairing_errors[addr] = problem
                raise _Unpaired(f"refusing to pair with the prefill: {problem}")
            self.pairing_errors.pop(addr, None)
            peer.conn = conn
        except (TimeoutError, OSError, ConnectionError, ValueError) as e:
            log.error("cannot use prefill %s: %s", addr, e)
            if conn is not None:
                conn.close()
            # A pairing mismatch (I7) is configuration the client may see; a failed dial says
            # nothing more: the resolver's and the socket's words are the operator's (log).
            peer.error = f"{UNAVAILABLE}: {e}" if isinstance(e, _Unpaired) else UNAVAILABLE
            self.peers.pop(key, None)  # the next request tries again
            peer.ready.set()
            return
        peer.idle_since = time.monotonic()
        peer.ready.set()
        try:
            await self._read(key, peer)
        finally:
            if self.peers.get(key) is peer:
                del self.peers[key]
            # The reader has stopped: nothing more of this connection can reach the pool.
            self._lost(set(peer.rooms))

    def room_ended(self, key: PeerKey | None, rid: str) -> None:
        peer = self.peers.get(key) if key is not None else None
        if peer is not None:
            peer.rooms.discard(rid)
            if not peer.rooms:
                peer.idle_since = time.monotonic()

    def send(self, key: PeerKey | None, msg: wire.Frame) -> bool:
        """To a room's prefill, in order with the connection's other frames; nowhere (False)
        when the room has no connection (never dialled, or gone: its reader fails the room)."""
        peer = self.peers.get(key) if key is not None else None
        if peer is None or peer.conn is None:
            return False
        asyncio.ensure_future(safe_send(peer.conn, msg))
        return True

    def fence(self, key: PeerKey | None, rid: str) -> None:
        """No ABORT_ACK came: close the connection, whose reader then stops and every room on it
        is released safely (I4)."""
        peer = self.peers.get(key) if key is not None else None
        if peer is not None and peer.conn is not None:
            log.error("no ABORT_ACK for room %s: closing connection to %s", rid, key)
            peer.conn.close()

    def close_idle(self, now: float) -> None:
        """Close prefill connections that carried no room for the idle timeout: each holds fds
        and buffers on both sides. Its reader then ends and forgets it; a later request dials
        afresh."""
        for key, peer in list(self.peers.items()):
            idle = now - peer.idle_since > self.limits.idle_timeout_s
            if peer.conn is not None and not peer.rooms and idle:
                log.info("closing idle connection to prefill %s:%s", *key)
                self.stats.inc("idle_closed")
                peer.conn.close()

    def close_all(self) -> None:
        for peer in list(self.peers.values()):
            if peer.conn is not None:
                peer.conn.close()


class Bootstrap:
    """Prefill's decode connections: the listener (TLS and the role check first, at most
    max_pending handshakes at once), HELLO and the pairing check, then each connection's frames
    to on_message until it ends, when lost(conn) fails the rooms it carried."""

    def __init__(
        self,
        setup: PeerSetup,
        link: PageSender,
        on_message: Callable[[Connection, wire.Frame], None],
        lost: Callable[[Connection], None],
    ) -> None:
        self.tls, self.faults, self.timeout_s = setup.tls, setup.faults, setup.timeout_s
        self.limits, self.pairing, self.stats = setup.limits, setup.pairing, setup.stats
        self.link, self._on_message, self._lost = link, on_message, lost
        self.server: Listener | None = None
        self.conns: set[Connection] = set()

    async def listen(self, host: str, port: int) -> int:
        self.server = await Listener.start(
            host,
            port,
            self._serve,
            self.tls,
            self.faults,
            max_pending=self.limits.max_pending_handshakes,
            handshake_timeout=self.limits.handshake_timeout_s,
            on_refused=lambda reason: self.stats.inc(f"handshakes_refused_{reason}"),
        )
        return self.server.port

    async def _serve(self, conn: Connection) -> None:
        self.conns.add(conn)
        try:
            if not await self._handshake(conn):
                return
            while True:
                msg, _ = await conn.recv()
                self._on_message(conn, msg)
        except asyncio.CancelledError:
            pass  # shutting down: asyncio would log a cancelled connection callback as an error
        except (ConnectionError, wire.WireError, asyncio.IncompleteReadError, TimeoutError) as e:
            if isinstance(e, (wire.WireError, RecordError)):
                # Malformed, or a record TLS refused (forged, replayed, injected): counted, the
                # connection dropped, nothing else.
                self.stats.inc("bad_frames")
                log.warning("dropping connection from %s: %s", conn.peer, e)
        finally:
            conn.close()
            self.conns.discard(conn)
            self.link.peer_left(conn)
            self._lost(conn)

    async def _handshake(self, conn: Connection) -> bool:
        """The pairing facts (I7), exchanged inside this connection's TLS session: the decode
        proved its certificate before a byte of this was read."""
        msg, _ = await asyncio.wait_for(conn.recv(), self.timeout_s)
        if not isinstance(msg, wire.Hello):
            raise wire.WireError("expected Hello")
        problem = pairing_problem(self.pairing, msg.info, self.faults.guards())
        if problem is not None:
            self.stats.inc("pairing_refused")
            log.error("refusing to pair with decode %s: %s", conn.peer, problem)
            await conn.send(wire.HelloRefused(problem))
            return False
        self.link.peer_joined(conn, msg.info)
        await conn.send(wire.HelloOk(dict(self.pairing)))
        return True

    def close_all(self) -> None:
        if self.server is not None:
            self.server.close()
        for conn in list(self.conns):
            conn.close()
