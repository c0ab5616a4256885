"""No dialling on a client's word (issue 15, item 4): a decode connects only to a prefill address
its router signed (server/hop.py), checked before any page is reserved or any socket opened; a
connect failure tells the client "prefill unavailable" and nothing of the resolver or the socket.
Twin: skip_hop_check (the old decode dialled whatever X-Kvfence-Prefill named)."""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator

import pytest
from conftest import TINY_MODEL
from fastapi.testclient import TestClient
from tls_certs import tls
from waiting import wait_for

from kvfence.config import EngineConfig
from kvfence.faults import Faults
from kvfence.pd.decode import DecodeService
from kvfence.server.api import build_app
from kvfence.server.hop import HEADER_PREFILL, HEADER_SIGNATURE, sign_prefill
from kvfence.tools.cluster import free_port

OPERATOR_KEY = "op-hop-tests-0123456789abcdef"
TENANT = {"Authorization": "Bearer sk-tenant-a"}
BODY = {"model": "kvfence-tiny", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture(scope="module")
def decode() -> Iterator[tuple[TestClient, DecodeService, Faults]]:
    faults = Faults()
    cfg = EngineConfig(model=str(TINY_MODEL), kv_pool_tokens=1024, context_length=128)
    svc = DecodeService(cfg, 5.0, "tcp", tls("decode"), faults)
    app = build_app(svc, api_keys={"sk-tenant-a": "a"}, faults=faults, operator_key=OPERATOR_KEY)
    svc.start()
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, svc, faults
    finally:
        svc.shutdown()


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """Somewhere a decode must not dial: it records any connect as a pending accept."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    try:
        yield s
    finally:
        s.close()


def _connected(s: socket.socket, timeout: float) -> bool:
    return bool(select.select([s], [], [], timeout)[0])


def _target(s: socket.socket) -> str:
    return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_tenant_naming_a_prefill_is_refused_and_nothing_is_dialled(decode, listener) -> None:
    client, svc, _ = decode
    addr = _target(listener)
    forged = {HEADER_PREFILL: addr, HEADER_SIGNATURE: "9999999999.00.deadbeef"}
    # Signed by the router, but for another address: the signature covers the address.
    moved = {**sign_prefill(OPERATOR_KEY, "127.0.0.1:1"), HEADER_PREFILL: addr}
    for headers in ({HEADER_PREFILL: addr}, forged, moved):
        r = client.post("/v1/completions", json=BODY, headers={**TENANT, **headers})
        assert r.status_code == 403, r.text
        assert r.json()["error"]["code"] == "unsigned_prefill"
    assert not _connected(listener, 0.0), "the decode dialled an address a client named"
    assert svc.peers == {} and svc.engine.stats().pages_used == 0


@pytest.mark.parametrize(
    "expiry",
    # Found by fuzzing (tests/fuzz): str.isdigit() takes a superscript two, which int() refuses,
    # and int() refuses more than 4,300 digits; both were a 500 instead of the 403.
    [b"\xb2", b"9" * 5000],
)
def test_fuzz_an_expiry_int_cannot_read_is_a_403_not_a_500(decode, listener, expiry) -> None:
    client, svc, _ = decode
    headers = {HEADER_PREFILL: _target(listener), HEADER_SIGNATURE: expiry + b".00.deadbeef"}
    r = client.post("/v1/completions", json=BODY, headers={**TENANT, **headers})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "unsigned_prefill"
    assert not _connected(listener, 0.0)


def test_twin_without_the_hop_check_the_decode_dials_the_clients_address(decode, listener) -> None:
    client, _, faults = decode
    box: dict = {}
    with faults.injected("skip_hop_check"):
        t = threading.Thread(
            target=lambda: box.setdefault("r", client.post(
                "/v1/completions", json=BODY, headers={**TENANT, HEADER_PREFILL: _target(listener)}
            )),
            daemon=True,
        )
        t.start()
        try:
            assert _connected(listener, 30.0), "the twin was meant to dial the client's address"
        finally:
            conn, _ = listener.accept() if _connected(listener, 0.0) else (None, None)
            if conn is not None:
                conn.close()  # the decode's handshake fails now, and the request with it
            t.join(30)
    assert box["r"].status_code == 503


def test_a_connect_failure_says_prefill_unavailable_and_no_more(decode) -> None:
    client, svc, _ = decode
    r = client.post("/v1/completions", json=BODY,
                    headers={**TENANT, **sign_prefill(OPERATOR_KEY, f"127.0.0.1:{free_port()}")})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "prefill unavailable" in message
    for detail in ("Errno", "refused", "Connect call failed", "127.0.0.1"):
        assert detail not in message, message
    # The room's release reaches the engine thread as a posted command, after the 503 is out.
    wait_for(lambda: svc.engine.stats().pages_used == 0, 30,
             lambda: f"pages still used: {svc.engine.stats().pages_used}", interval=0.05)


def test_a_signed_address_is_good_for_one_request(decode, listener) -> None:
    client, _, _ = decode
    signed = sign_prefill(OPERATOR_KEY, f"127.0.0.1:{free_port()}")
    first = client.post("/v1/completions", json=BODY, headers={**TENANT, **signed})
    assert first.status_code == 503  # dialled (a closed port), as the router asked
    again = client.post("/v1/completions", json=BODY, headers={**TENANT, **signed})
    assert again.status_code == 403 and "already used" in again.json()["error"]["message"]
