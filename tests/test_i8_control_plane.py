"""I8: the PD control plane and the KV bytes run on TLS 1.3 with mutual certificates from the
cluster CA, each naming its role. A peer without such a certificate, a recorded handshake
replayed, a record replayed or injected, or malformed frames inside a session change nothing,
are counted, and reveal nothing: a fake prefill never receives a RESERVE. Before a peer has
proved its certificate it holds little (capped handshakes, each with a deadline). Decode keys
its prefill connections by the resolved address, closes idle ones, and tells a client only
"prefill unavailable". Twin: `skip_peer_verify` (any certificate passes)."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest
from conftest import random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st
from pd_harness import PDPair, Result
from tls_certs import files, impostor
from waiting import wait_for

from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.pd import protocol as p
from kvfence.pd import wire
from kvfence.pd.certs import TlsFiles
from kvfence.pd.transport.tcp import LinkLimits

PENDING_CAP = 8
LIMITS = LinkLimits(
    handshake_timeout_s=1.0, max_pending_handshakes=PENDING_CAP, idle_timeout_s=1.5
)


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    pd = PDPair(
        str(checkpoint_dir("llama")), kv_pool_tokens=512, context_length=128, limits=LIMITS
    )
    yield pd
    pd.close()


def frame(msg, payload: bytes = b"") -> bytes:
    return b"".join(bytes(b) for b in wire.encode(msg, payload))


def reserve(room: str) -> p.Reserve:
    return p.Reserve(room, "mallory", (5, 6, 7), {}, 4, (1,), 1)


def context(f: TlsFiles, server: bool) -> ssl.SSLContext:
    """What a hand-driven peer holding f would use (verifying nothing itself: it is the one
    being tested)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(f.cert, f.key)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def read_frame(sock: socket.socket) -> wire.Frame:
    def exactly(n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("closed")
            out += chunk
        return out

    header_len, payload_len = wire.parse_prefix(exactly(wire.PREFIX_SIZE))
    msg = wire.decode_header(exactly(header_len))
    exactly(payload_len)
    return msg


def closed_by_peer(sock: socket.socket) -> bool:
    """Drain whatever the peer still sends (e.g. an ABORT_ACK); True once it hangs up."""
    sock.settimeout(5)
    try:
        while sock.recv(65536):
            pass
    except (ConnectionResetError, ssl.SSLError):
        pass
    except TimeoutError:
        return False
    return True


class Raw:
    """A hand-driven client of the bootstrap port: TLS with the given certificate (or none),
    then whatever bytes a test wants."""

    def __init__(self, port: int, cert: TlsFiles | None = None) -> None:
        tcp = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock = context(cert, server=False).wrap_socket(tcp) if cert else tcp

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def hello(self, pair: PDPair) -> wire.Frame:
        self.send(frame(wire.Hello(dict(pair.decode.pairing))))
        return read_frame(self.sock)


class Tap:
    """A TCP relay between one client and a server that records both directions and can inject
    bytes into either: the attacker on the wire."""

    def __init__(self, target: int) -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.c2s: list[bytes] = []
        self.s2c: list[bytes] = []
        self.upstream: socket.socket | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._run, args=(target,), daemon=True).start()

    def _run(self, target: int) -> None:
        down, _ = self.srv.accept()
        up = socket.create_connection(("127.0.0.1", target))
        self.upstream = up
        self.ready.set()
        for src, dst, log in ((down, up, self.c2s), (up, down, self.s2c)):
            threading.Thread(target=_pump, args=(src, dst, log), daemon=True).start()

    def c2s_bytes(self) -> int:
        return sum(len(c) for c in self.c2s)

    def close(self) -> None:
        self.srv.close()


def _pump(src: socket.socket, dst: socket.socket, log: list[bytes]) -> None:
    try:
        while chunk := src.recv(65536):
            log.append(chunk)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def snapshot(pair: PDPair) -> tuple:
    return (
        pair.prefill.transfer_stats.get("reserves"),
        len(pair.prefill.rooms),
        pair.prefill.engine.pool.num_used,
    )


def refused(pair: PDPair) -> int:
    stats = pair.prefill.transfer_stats
    return sum(v for k, v in stats.snapshot().items() if k.startswith("handshakes_refused"))


def bad_frames(pair: PDPair) -> int:
    return pair.prefill.transfer_stats.get("bad_frames")


# ---- who may connect to a prefill ----------------------------------------------------------


@pytest.mark.parametrize("who", ["plaintext", "impostor-decode", "cluster-prefill"])
def test_i8_bootstrap_refuses_a_client_without_a_decode_certificate(pair: PDPair, who: str):
    """No TLS, a decode certificate from another CA, or the cluster's certificate of the wrong
    role: the hello and the RESERVE behind it are never read."""
    before, n_refused = snapshot(pair), refused(pair)
    cert = {"plaintext": None, "impostor-decode": impostor("decode")}.get(who, files("prefill"))
    try:
        raw = Raw(pair.prefill.port, cert)
        raw.send(frame(wire.Hello(dict(pair.decode.pairing))) + frame(reserve("f" * 32)))
        assert closed_by_peer(raw.sock)
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        pass  # refused inside the handshake already
    wait_for(lambda: refused(pair) > n_refused, 10, "the refused handshake was not counted")
    assert snapshot(pair) == before


def test_i8_twin_without_peer_verification_an_impostor_reserve_is_acted_on(pair: PDPair):
    with pair.faults.injected("skip_peer_verify"):
        before = snapshot(pair)
        raw = Raw(pair.prefill.port, impostor("decode"))
        assert isinstance(raw.hello(pair), wire.HelloOk)
        raw.send(frame(reserve("d" * 32)))
        wait_for(lambda: snapshot(pair) != before, 5, "the impostor's RESERVE was not acted on")
        raw.sock.close()
    assert pair.wait_idle(15)


def test_i8_recorded_session_replayed_into_a_new_connection_is_refused(pair: PDPair):
    """Every byte a real decode sent in one session (handshake, HELLO, a frame), replayed on a
    new connection: the server's fresh randomness makes the recorded handshake fail."""
    tap = Tap(pair.prefill.port)
    client = Raw(tap.port, files("decode"))
    assert isinstance(client.hello(pair), wire.HelloOk)
    mark = tap.c2s_bytes()
    client.send(frame(p.Abort("a" * 32, "x", "y", 400)))  # harmless, but authentic
    wait_for(lambda: tap.c2s_bytes() > mark, 5, "the frame was not relayed")
    recorded = b"".join(tap.c2s)
    before, n_refused = snapshot(pair), refused(pair)
    replay = Raw(pair.prefill.port)
    replay.send(recorded)
    assert closed_by_peer(replay.sock)
    wait_for(lambda: refused(pair) > n_refused, 10, "the replayed handshake was not counted")
    assert snapshot(pair) == before
    client.sock.close()
    tap.close()


@pytest.mark.parametrize("how", ["replayed", "injected"])
def test_i8_record_replayed_or_injected_into_a_session_is_refused(pair: PDPair, how: str):
    """Someone on the wire repeats a record of this session, or writes bytes of their own into
    it: TLS refuses the record, the connection is dropped, nothing it carried counts."""
    tap = Tap(pair.prefill.port)
    client = Raw(tap.port, files("decode"))
    assert isinstance(client.hello(pair), wire.HelloOk)
    mark = tap.c2s_bytes()
    client.send(frame(p.Abort("b" * 32, "x", "y", 400)))
    wait_for(lambda: tap.c2s_bytes() > mark, 5, "the record was not relayed")
    record = b"".join(tap.c2s)[mark:]
    before, bad = snapshot(pair), bad_frames(pair)
    assert tap.upstream is not None
    forged = bytes([0x17, 0x03, 0x03, 0, 40]) + b"\x00" * 40  # an application_data record
    tap.upstream.sendall(record if how == "replayed" else forged)
    wait_for(lambda: bad_frames(pair) > bad, 5, "the bad record was not counted")
    assert closed_by_peer(client.sock)
    assert snapshot(pair) == before
    tap.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64,
        wire.MAGIC + b"\xff" * 60,
        # Sizes within the wire's bounds, but more than a hello may carry: refused unread.
        wire.MAGIC + (2 << 20).to_bytes(4, "big") + (1 << 20).to_bytes(8, "big") + b"\x00" * 56,
        b"\x00" * 80,
    ],
    ids=["http", "huge-sizes", "big-hello", "zeros"],
)
def test_i8_malformed_frames_inside_a_session_are_dropped(pair: PDPair, garbage: bytes):
    before, bad = snapshot(pair), bad_frames(pair)
    raw = Raw(pair.prefill.port, files("decode"))
    raw.send(garbage)
    assert closed_by_peer(raw.sock)
    wait_for(lambda: bad_frames(pair) > bad, 5, "the bad frame was not counted")
    assert snapshot(pair) == before


def test_i8_truncated_frame_changes_nothing(pair: PDPair) -> None:
    before = snapshot(pair)
    raw = Raw(pair.prefill.port, files("decode"))
    assert isinstance(raw.hello(pair), wire.HelloOk)
    whole = frame(reserve("c" * 32))
    raw.send(whole[: len(whole) // 2])
    raw.sock.close()
    time.sleep(0.3)
    assert snapshot(pair) == before


def test_pd_decodes_ack_of_a_prefill_abort_keeps_the_connection(pair: PDPair) -> None:
    """Decode acknowledges every ABORT prefill sends (a refusal at prefill's door, a draining
    prefill, a prefill timeout): prefill must take the ack as the end of that room, not as a
    bad frame that drops the connection and fails every other room of that decode with it.
    Each next RESERVE is answered only if the connection survived the previous ack."""
    bad = bad_frames(pair)
    raw = Raw(pair.prefill.port, files("decode"))
    assert isinstance(raw.hello(pair), wire.HelloOk)
    for room in ("e" * 32, "f" * 32, "0" * 32):
        # An empty prompt: refused at prefill's door, answered with an ABORT.
        raw.send(frame(p.Reserve(room, "mallory", (), {}, 4, (1,), 1)))
        try:
            got = read_frame(raw.sock)
        except (ConnectionError, ssl.SSLError) as e:
            pytest.fail(f"prefill dropped the connection after decode's ABORT_ACK: {e}")
        assert isinstance(got, p.Abort) and got.room == room, got
        raw.send(frame(p.AbortAck(room)))  # what decode's state machine answers
    assert bad_frames(pair) == bad
    raw.sock.close()


# ---- bounded before authentication ----------------------------------------------------------


def test_i8_bootstrap_caps_connections_still_in_their_handshake(pair: PDPair) -> None:
    listener = pair.prefill._server
    assert listener is not None
    stats = pair.prefill.transfer_stats
    over = stats.get("handshakes_refused_too_many_handshakes")
    port = pair.prefill.port
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(PENDING_CAP)]
    wait_for(lambda: listener.pending == PENDING_CAP, 5, "the silent peers were not accepted")
    extra = socket.create_connection(("127.0.0.1", port))
    assert closed_by_peer(extra), "a connection over the cap was kept"
    wait_for(
        lambda: stats.get("handshakes_refused_too_many_handshakes") > over,
        5,
        "the connection over the cap was not counted",
    )
    for s in silent:
        s.close()
    wait_for(lambda: listener.pending == 0, 10, "closed handshakes still counted as pending")
    pair.generate(random_prompts([20], 256), SamplingParams(max_tokens=2))


def test_i8_bootstrap_drops_a_handshake_past_its_deadline(pair: PDPair) -> None:
    silent = socket.create_connection(("127.0.0.1", pair.prefill.port))
    silent.send(b"\x16\x03\x01")  # the start of a ClientHello, never finished
    assert closed_by_peer(silent), "a stalled handshake was kept past its deadline"


# ---- whom a decode sends a request to -------------------------------------------------------


class FakePrefill:
    """A listener posing as a prefill: TLS with `cert` (or, with `replay`, the recorded bytes of
    a real prefill's session sent back raw), then a HELLO_OK with the real prefill's pairing
    facts. It records every frame it can read: a RESERVE among them would be the leak."""

    def __init__(self, pair: PDPair, cert: TlsFiles | None, replay: bytes = b"") -> None:
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.frames: list[wire.Frame] = []
        self.hello_ok = wire.HelloOk(dict(pair.prefill.pairing))  # what it "recorded"
        threading.Thread(target=self._serve, args=(cert, replay), daemon=True).start()

    def _serve(self, cert: TlsFiles | None, replay: bytes) -> None:
        try:
            conn, _ = self.srv.accept()
            conn.settimeout(10)
            if replay:
                conn.recv(65536)  # the decode's ClientHello
                conn.sendall(replay)
                while conn.recv(65536):
                    pass
                return
            assert cert is not None
            sock = context(cert, server=True).wrap_socket(conn, server_side=True)
            while True:
                msg = read_frame(sock)
                self.frames.append(msg)
                if isinstance(msg, wire.Hello):
                    sock.sendall(frame(self.hello_ok))
        except (OSError, ConnectionError, wire.WireError):
            pass

    def reserves(self) -> list[p.Reserve]:
        return [f for f in self.frames if isinstance(f, p.Reserve)]

    def close(self) -> None:
        self.srv.close()


def submit_via(pair: PDPair, addr: str, prompt: list[int]) -> Result:
    real, pair.peer = pair.peer, addr
    try:
        _, r = pair.submit(prompt, SamplingParams(max_tokens=2))
    finally:
        pair.peer = real
    assert isinstance(r, Result)
    return r


def failed_unavailable(r: Result) -> bool:
    assert r.done.wait(30), "the request did not end"
    final = r.final
    assert final is not None
    return (
        final.finish_reason is FinishReason.ERROR
        and final.error_status == 503
        and "prefill unavailable" in str(final.error)
    )


@pytest.mark.parametrize("cert", ["impostor-prefill", "cluster-decode"])
def test_i8_fake_prefill_with_a_recorded_hello_ok_gets_no_reserve(pair: PDPair, cert: str):
    """The replay of finding 2: a listener serving a real prefill's HELLO_OK. Its certificate
    (another CA's, or the cluster's of the wrong role) fails decode's check inside the TLS
    handshake, before the HELLO, and the prompt never leaves."""
    fake = FakePrefill(
        pair, impostor("prefill") if cert == "impostor-prefill" else files("decode")
    )
    prompt = random_prompts([20], 256)[0]
    r = submit_via(pair, fake.addr, prompt)
    assert failed_unavailable(r)
    assert fake.frames == [], f"the fake prefill read {fake.frames}"
    assert pair.wait_idle()
    fake.close()


def test_i8_twin_without_peer_verification_the_fake_prefill_gets_the_prompt(pair: PDPair):
    fake = FakePrefill(pair, impostor("prefill"))
    prompt = random_prompts([20], 256)[0]
    with pair.faults.injected("skip_peer_verify"):
        submit_via(pair, fake.addr, prompt)
        wait_for(lambda: fake.reserves(), 10, "the fake prefill got no RESERVE")
    assert fake.reserves()[0].prompt == tuple(prompt)
    pair.decode.loop.call_soon_threadsafe(pair.decode._close_all)
    assert pair.wait_idle(30)
    fake.close()


def test_i8_replayed_prefill_handshake_bytes_fail_at_decode(pair: PDPair) -> None:
    """A real prefill's side of a real session, recorded on the wire and replayed verbatim to
    a later dial: the decode's fresh ClientHello makes it fail; the request gets a 503."""
    tap = Tap(pair.prefill.port)
    good = submit_via(pair, f"127.0.0.1:{tap.port}", random_prompts([20], 256)[0])
    assert good.done.wait(30) and good.final is not None
    assert good.final.finish_reason is not FinishReason.ERROR, good.final.error
    fake = FakePrefill(pair, None, replay=b"".join(tap.s2c))
    r = submit_via(pair, fake.addr, random_prompts([20], 256)[0])
    assert failed_unavailable(r)
    assert pair.wait_idle()
    tap.close()
    fake.close()


# ---- decode's connections: keyed, closed when idle, failures without detail -------------------


def test_pd_spellings_of_one_prefill_address_share_one_connection(pair: PDPair) -> None:
    port = pair.prefill.port
    for addr in (f"127.0.0.1:{port}", f"127.0.0.00001:{port}", f"localhost:{port}"):
        if addr.startswith("localhost") and socket.getaddrinfo("localhost", port)[0][4][0] != (
            "127.0.0.1"
        ):
            continue  # localhost resolves to ::1 first here: another address, rightly
        r = submit_via(pair, addr, random_prompts([20], 256)[0])
        assert r.done.wait(30) and r.final is not None
        assert r.final.finish_reason is not FinishReason.ERROR, r.final.error
        # (the idle timeout may have closed it since: then there is none)
        to_it = {k for k in pair.decode.peers if str(port) in str(k)}
        assert to_it <= {("127.0.0.1", port)}, pair.decode.peers


def test_pd_idle_prefill_connection_is_closed_and_redialled(pair: PDPair) -> None:
    pair.generate(random_prompts([20], 256), SamplingParams(max_tokens=2))
    closed = pair.decode.transfer_stats.get("idle_closed")
    wait_for(lambda: not pair.decode.peers, 15, "the idle connection was not closed")
    assert pair.decode.transfer_stats.get("idle_closed") > closed
    pair.generate(random_prompts([20], 256), SamplingParams(max_tokens=2))


@pytest.mark.parametrize("addr", ["127.0.0.1:1", "no-such-host.invalid:8998", "not-an-address"])
def test_pd_unusable_prefill_is_unavailable_without_detail(pair: PDPair, addr: str) -> None:
    r = submit_via(pair, addr, random_prompts([20], 256)[0])
    assert failed_unavailable(r)
    assert r.final is not None
    for detail in ("refused", "Errno", "Name or service", "resolve", "timed out"):
        assert detail not in str(r.final.error)
    assert pair.wait_idle()


# ---- the frame decoder ----------------------------------------------------------------------


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
        header_len, payload_len = wire.parse_prefix(data)
    except wire.WireError:
        return
    assert header_len <= wire.MAX_HEADER and payload_len <= wire.MAX_PAYLOAD
