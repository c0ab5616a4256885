"""A payload decrypted straight into the receiver's memory (transport.tcp.Placement) stops
landing there the moment the receiver says it no longer may (decode: its room left RESERVED, so
its pages may be released): nothing after that point is written, the rest of the frame is read
and dropped, and the connection carries on. The twin keeps writing and shows the test catches
the late bytes."""

from __future__ import annotations

import asyncio

from tls_certs import tls

from kvfence.pd import wire
from kvfence.pd.transport.tcp import Connection, Listener, Placement

# Under a record each: the receiver then wakes for any bytes (the read mark stays at 1), and
# waits for the second half with the first one already in place.
HALF = 8 << 10


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
        await prefill._send_all(prefix)
        await prefill._send_all(payload[:HALF])
        # The first half has landed (bounded wait on the bytes themselves, not on time).
        for _ in range(10_000):
            if dst[HALF - 1] == 1:
                break
            await asyncio.sleep(0.001)
        assert dst[HALF - 1] == 1, "the first half never arrived"
        assert not received.done()
        if stop_midway:
            allowed[0] = False  # e.g. the room was released while its run was arriving
        await prefill._send_all(payload[HALF:])
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
