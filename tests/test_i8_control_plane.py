"""I8: transfer frames are authenticated under the cluster secret. Forged, replayed, truncated
or malformed frames sent raw to a prefill's bootstrap port are rejected, counted, and change
nothing; a decode refuses a prefill that cannot prove the secret. Twin: `skip_mac`."""

from __future__ import annotations

import socket
import time

import pytest
from conftest import random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_harness import SECRET, PDPair, Result
from waiting import wait_for

from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.pd import auth, wire
from kvfence.pd import protocol as p


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    pd = PDPair(str(checkpoint_dir("llama")), kv_pool_tokens=512, context_length=128)
    yield pd
    pd.close()


def frame(msg, mac: auth.FrameMac | bytes, seq: int, payload: bytes = b"") -> bytes:
    """A whole frame; a bare key means the hello phase's MAC under it."""
    if isinstance(mac, bytes):
        mac = auth.HelloMac(mac)
    return b"".join(bytes(b) for b in wire.encode(msg, payload, seq, mac))


def reserve(room: str) -> p.Reserve:
    return p.Reserve(room, "mallory", (5, 6, 7), {}, 4, (1,), 1)


class Raw:
    """A hand-driven client of the bootstrap port, speaking whatever bytes a test wants."""

    def __init__(self, pair: PDPair) -> None:
        self.sock = socket.create_connection(("127.0.0.1", pair.prefill.port), timeout=5)
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)
        self.sock.sendall(data)

    def handshake(self, pair: PDPair, secret: bytes) -> auth.SessionMac:
        """Hello under `secret`; returns this client's sending MAC (only right if secret is)."""
        nonce = auth.new_nonce()
        self.send(
            frame(wire.Hello({**pair.decode.pairing, "nonce": nonce}), auth.hello_key(secret), 1)
        )
        data = self.sock.recv(65536)
        header_len = wire.parse_prefix(data[: wire.PREFIX_SIZE])[0]
        start = wire.PREFIX_SIZE + wire.MAC_SIZE
        ok = wire.decode_header(data[start : start + header_len])
        return auth.SessionMac(auth.session_keys(secret, nonce, ok.info["nonce"])[0])

    def closed_by_peer(self) -> bool:
        """Drain whatever the peer still sends (e.g. an ABORT_ACK); True once it hangs up."""
        self.sock.settimeout(5)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return False
        return True


def snapshot(pair: PDPair) -> tuple:
    return (
        pair.prefill.transfer_stats.get("reserves"),
        len(pair.prefill.rooms),
        pair.prefill.engine.pool.num_used,
    )


def settle(pair: PDPair, bad_before: int) -> None:
    wait_for(lambda: pair.prefill.transfer_stats.get("bad_frames") > bad_before, 5,
             "the bad frame was not counted")


def test_i8_hello_without_the_secret_is_refused(pair: PDPair) -> None:
    before, bad = snapshot(pair), pair.prefill.transfer_stats.get("bad_frames")
    raw = Raw(pair)
    raw.send(frame(wire.Hello(pair.decode.pairing), auth.hello_key(b"not-the-secret-at-all"), 1))
    raw.send(frame(reserve("f" * 32), auth.hello_key(b"not-the-secret-at-all"), 2))
    assert raw.closed_by_peer()
    settle(pair, bad)
    assert snapshot(pair) == before


def test_i8_frame_replayed_into_another_connection_is_refused(pair: PDPair) -> None:
    first = Raw(pair)
    key = first.handshake(pair, SECRET)
    captured = frame(p.Abort("a" * 32, "x", "y", 400), key, 1)  # harmless, but authentic
    first.send(captured)
    before, bad = snapshot(pair), pair.prefill.transfer_stats.get("bad_frames")
    second = Raw(pair)
    second.handshake(pair, SECRET)
    second.send(captured)  # valid MAC under the FIRST connection's key only
    assert second.closed_by_peer()
    settle(pair, bad)
    assert snapshot(pair) == before


def test_i8_frame_replayed_on_the_same_connection_is_refused(pair: PDPair) -> None:
    raw = Raw(pair)
    key = raw.handshake(pair, SECRET)
    captured = frame(p.Abort("b" * 32, "x", "y", 400), key, 1)
    raw.send(captured)
    bad = pair.prefill.transfer_stats.get("bad_frames")
    raw.send(captured)  # same bytes, same sequence number
    assert raw.closed_by_peer()
    settle(pair, bad)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,
        wire.MAGIC + b"\xff" * 60,
        # Sizes within the wire's bounds, but more than a hello may carry before any key.
        wire.MAGIC + (2 << 20).to_bytes(4, "big") + (1 << 20).to_bytes(8, "big") + b"\x00" * 56,
        b"\x00" * 80,
    ],
    ids=["http", "huge-sizes", "big-hello", "zeros"],
)
def test_i8_malformed_frames_are_dropped(pair: PDPair, garbage: bytes) -> None:
    before, bad = snapshot(pair), pair.prefill.transfer_stats.get("bad_frames")
    raw = Raw(pair)
    raw.send(garbage)
    assert raw.closed_by_peer()
    settle(pair, bad)
    assert snapshot(pair) == before


def test_i8_truncated_frame_changes_nothing(pair: PDPair) -> None:
    before = snapshot(pair)
    raw = Raw(pair)
    key = raw.handshake(pair, SECRET)
    whole = frame(reserve("c" * 32), key, 1)
    raw.send(whole[: len(whole) // 2])
    raw.sock.close()
    time.sleep(0.3)
    assert snapshot(pair) == before


def test_i8_twin_without_mac_a_forged_reserve_is_acted_on(pair: PDPair) -> None:
    with pair.faults.injected("skip_mac"):
        before = snapshot(pair)
        raw = Raw(pair)
        raw.send(frame(wire.Hello(pair.decode.pairing), b"\x00" * 32, 7))
        raw.send(frame(reserve("d" * 32), b"\x00" * 32, 99))
        wait_for(lambda: snapshot(pair) != before, 5, "the forged RESERVE was not acted on")
        raw.sock.close()


def test_i8_decode_refuses_a_prefill_without_the_secret(pair: PDPair) -> None:
    """A listener that answers HELLO_OK under the wrong key: decode must not pair with it."""
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def impostor() -> None:
        conn, _ = srv.accept()
        conn.recv(65536)
        ok = wire.HelloOk({**pair.prefill.pairing, "nonce": auth.new_nonce()})
        conn.sendall(frame(ok, auth.hello_key(b"impostor-does-not-know-it"), 1))
        time.sleep(1)
        conn.close()

    threading.Thread(target=impostor, daemon=True).start()
    real_peer, pair.peer = pair.peer, f"127.0.0.1:{srv.getsockname()[1]}"
    try:
        _, r = pair.submit(random_prompts([20], 256)[0], SamplingParams(max_tokens=2))
        assert isinstance(r, Result) and r.done.wait(30)
        assert r.final.finish_reason is FinishReason.ERROR and r.final.error_status == 503
        assert pair.wait_idle()
    finally:
        pair.peer = real_peer
        srv.close()


def test_i8_frame_reflected_to_its_sender_is_refused() -> None:
    """Each direction has its own session key: a frame a side sent, bounced back to it by
    someone on the path, fails its MAC even though its sequence number fits."""
    import asyncio

    from kvfence.pd.transport.tcp import Connection

    async def go() -> None:
        mine, theirs = socket.socketpair()
        conn = Connection(mine, SECRET, client=True)
        conn.start_session("c" * 32, "s" * 32)
        await conn.send(p.Abort("e" * 32, "x", "y", 400))
        theirs.setblocking(True)
        sent = theirs.recv(65536)
        theirs.sendall(sent)  # the same bytes, back where they came from
        with pytest.raises(wire.WireError, match="bad MAC"):
            await conn.recv()
        conn.close()
        theirs.close()

    asyncio.run(go())


def test_i8_page_runs_decode_strictly() -> None:
    import json

    ok = {"t": "PageRun", "room": "a" * 32, "first": 0, "n_tokens": 16, "checksums": [1, 2]}
    assert wire.decode_header(json.dumps(ok).encode()).checksums == (1, 2)
    for bad in ([], [-1], [1 << 64], [1.5], ["1"], [True]):
        with pytest.raises(wire.WireError):
            wire.decode_header(json.dumps({**ok, "checksums": bad}).encode())


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=200))
def test_i8_fuzz_header_decoder_only_raises_wire_errors(data: bytes) -> None:
    try:
        wire.decode_header(data)
    except wire.WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(
            ["t", "room", "index", "first", "n_tokens", "checksum", "checksums", "prompt", "x"]
        ),
        st.one_of(
            st.integers(),
            st.text(max_size=8),
            st.lists(st.integers(), max_size=4),
            st.none(),
            st.booleans(),
            st.sampled_from(["PageRun", "Page", "Reserve", "Hello", "Done"]),
        ),
    )
)
def test_i8_fuzz_structured_headers_only_raise_wire_errors(obj: dict) -> None:
    import json

    try:
        wire.decode_header(json.dumps(obj).encode())
    except wire.WireError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=wire.PREFIX_SIZE, max_size=wire.PREFIX_SIZE))
def test_i8_fuzz_prefix_parser_bounds_sizes(data: bytes) -> None:
    try:
        header_len, payload_len, _ = wire.parse_prefix(data)
    except wire.WireError:
        return
    assert header_len <= wire.MAX_HEADER and payload_len <= wire.MAX_PAYLOAD
