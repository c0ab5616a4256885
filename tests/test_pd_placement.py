"""A payload decrypted straight into the receiver's memory (transport.tcp.Placement) stops
landing there the moment the receiver says it no longer may (decode: its room left RESERVED, so
its pages may be released): nothing after that point is written, the rest of the frame is read
and dropped, and the connection carries on. The twin keeps writing and shows the test catches
the late bytes. Decode's reader credits a placement only to the frame it was made for."""

from __future__ import annotations

import asyncio
import time

from conftest import TINY_MODEL
from tls_certs import tls

from kvfence.config import EngineConfig
from kvfence.pd import kvio, wire
from kvfence.pd import protocol as p
from kvfence.pd.decode import DecodeService, _Room
from kvfence.pd.peers import Peer
from kvfence.pd.transport.tcp import Connection, Listener, Placement

# Under a record each: the receiver then wakes for any bytes (the read mark stays at 1), and
# waits for the second half with the first one already in place.
HALF = 8 << 10


async def _send_piece(conn: Connection, piece: memoryview) -> None:
    """Part of a frame on the wire now (send() takes whole frames only)."""
    conn._encrypt(piece)
    await conn._flush()


async def _exchange(stop_midway: bool) -> tuple[bytearray, Placement, wire.Frame]:
    accepted: asyncio.Queue[Connection] = asyncio.Queue()
    listener = await Listener.start("127.0.0.1", 0, accepted.put, tls("prefill"))
    dst = bytearray(2 * HALF)
    allowed = [True]
    placement = Placement([memoryview(dst)[:HALF], memoryview(dst)[HALF:]], lambda: allowed[0])
    try:
        decode = await Connection.open("127.0.0.1", listener.port, 10, tls("decode"))
        prefill = await asyncio.wait_for(accepted.get(), 10)
        # Each side's first frame is the capped hello slot: use it up with empty frames.
        await decode.send(wire.Heartbeat())
        await prefill.send(wire.Heartbeat())
        await asyncio.wait_for(prefill.recv(), 10)
        await asyncio.wait_for(decode.recv(), 10)
        prefix, payload = wire.encode(
            wire.PageRun("r", 0, 1, (0,)), memoryview(b"\x01" * (2 * HALF))
        )
        received = asyncio.ensure_future(decode.recv(lambda _m, _n: placement))
        await _send_piece(prefill, prefix)
        await _send_piece(prefill, payload[:HALF])
        # The first half has landed (bounded wait on the bytes themselves, not on time).
        for _ in range(10_000):
            if dst[HALF - 1] == 1:
                break
            await asyncio.sleep(0.001)
        assert dst[HALF - 1] == 1, "the first half never arrived"
        assert not received.done()
        if stop_midway:
            allowed[0] = False  # e.g. the room was released while its run was arriving
        await _send_piece(prefill, payload[HALF:])
        await prefill.send(wire.Heartbeat())
        frame, rest = await asyncio.wait_for(received, 10)
        assert isinstance(frame, wire.PageRun) and rest.nbytes == 0
        after, _ = await asyncio.wait_for(decode.recv(), 10)  # the stream is still in step
        decode.close()
        prefill.close()
        return dst, placement, after
    finally:
        listener.close()


def test_placement_stops_writing_once_the_receiver_withdraws_it() -> None:
    dst, placement, after = asyncio.run(_exchange(stop_midway=True))
    assert dst[:HALF] == b"\x01" * HALF
    assert dst[HALF:] == bytes(HALF), "bytes landed after the placement was withdrawn"
    assert placement.dropped
    assert isinstance(after, wire.Heartbeat)


def test_twin_placement_left_valid_takes_the_whole_payload() -> None:
    dst, placement, after = asyncio.run(_exchange(stop_midway=False))
    assert dst == bytearray(b"\x01" * (2 * HALF))
    assert not placement.dropped
    assert isinstance(after, wire.Heartbeat)


async def _decode_reads(svc: DecodeService, frames: list[tuple[wire.Frame, bytes]]) -> None:
    """Decode's reader (decode_runs.RunReceiver.read) over a real TLS connection, fed `frames` by a
    hand-driven prefill that then hangs up."""
    accepted: asyncio.Queue[Connection] = asyncio.Queue()
    listener = await Listener.start("127.0.0.1", 0, accepted.put, tls("prefill"))
    try:
        conn = await Connection.open("127.0.0.1", listener.port, 10, tls("decode"))
        prefill = await asyncio.wait_for(accepted.get(), 10)
        await conn.send(wire.Heartbeat())  # the capped hello slots
        await prefill.send(wire.Heartbeat())
        await asyncio.wait_for(prefill.recv(), 10)
        await asyncio.wait_for(conn.recv(), 10)
        for msg, payload in frames:
            await prefill.send(msg, payload)
        prefill.close()
        await asyncio.wait_for(svc.receiver.read(("127.0.0.1", listener.port), Peer(conn=conn)), 30)
    finally:
        listener.close()


def test_a_run_without_payload_after_a_placed_run_is_not_taken_as_placed() -> None:
    """A PageRun whose payload is empty is never asked where to go (recv() asks only for a
    payload): it must not be credited with the previous run's placement and the hashes taken as
    that one landed. Over tcp it is a run of the wrong size: every page of it fails."""
    cfg = EngineConfig(model=str(TINY_MODEL), kv_pool_tokens=256, context_length=64)
    svc = DecodeService(cfg, tls=tls("decode"))
    try:
        _placed_then_empty_run(svc)
    finally:
        svc.shutdown()


def _placed_then_empty_run(svc: DecodeService) -> None:
    pool = svc.engine.pool
    size = pool.page_size
    rid = "a" * 32
    grant = pool.new_grant("t", rid)
    pages = pool.allocate(grant, 2)
    svc.pool_port.hand_over(grant)  # as on_reserved does: the room's pages are the reader's
    now = time.monotonic()
    svc.rooms[rid] = _Room(p.DecodeRoom(rid, 2 * size, 2), None, pages, grant, now + 60, now)
    data = bytes(range(256)) * (kvio.payload_size(pool, size) // 256)
    checksum = kvio.checksum(data)
    runs = [
        (wire.PageRun(rid, 0, size, (checksum,)), data),  # placed into pages[0]
        (wire.PageRun(rid, 1, size, (checksum,)), b""),  # nothing for pages[1]
    ]
    asyncio.run(_decode_reads(svc, runs))
    stats = svc.transfer_stats
    assert stats.get("pages_received") == 1, stats.snapshot()
    assert stats.get("checksum_mismatches") == 1, stats.snapshot()
