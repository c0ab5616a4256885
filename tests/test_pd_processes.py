"""PD roles as separate OS processes: a prefill or decode killed mid-transfer, or a client that
hangs up mid-transfer, each end with a clean error and the surviving pools back to baseline."""

from __future__ import annotations

import threading

import httpx
import pytest
from procs import OPERATOR, OPERATOR_KEY, serve
from waiting import wait_for

from kvfence.server.hop import sign_prefill

STALL = {"KVFENCE_FAULT_INJECTION": "1", "KVFENCE_FAULTS": "stall_transfer"}
BODY = {"model": "kvfence-tiny", "prompt": "code: X7qPz91LmWk2\n" * 20 + "code:",
        "max_tokens": 16, "temperature": 0}


@pytest.fixture
def pd(tmp_path):
    prefill = serve("prefill", tmp_path, env=STALL)
    decode = serve("decode", tmp_path)
    procs = [prefill, decode]
    try:
        for p in procs:
            p.wait_healthy()
        info = httpx.get(f"{prefill.url}/pd/info", headers=OPERATOR).json()
        yield prefill, decode, f"{info['bootstrap_host']}:{info['bootstrap_port']}"
    finally:
        for p in procs:
            p.stop()


def post(decode, peer: str, timeout: float = 30.0) -> httpx.Response:
    # Signed as the router signs it: the decode dials nothing on a client's word.
    return httpx.post(f"{decode.url}/v1/completions", json=BODY, timeout=timeout,
                      headers=sign_prefill(OPERATOR_KEY, peer))


def in_background(fn):
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    return t, box


def test_pd_processes_answer_through_the_stall(pd) -> None:
    prefill, decode, peer = pd
    r = post(decode, peer)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].startswith(" X7qPz91LmWk2")
    wait_for(lambda: prefill.pages_used() == 0 and decode.pages_used() == 0, 15,
             "both pools back to zero", interval=0.1)


def test_kill_prefill_mid_transfer_gives_503_and_decode_frees(pd) -> None:
    prefill, decode, peer = pd
    t, box = in_background(lambda: post(decode, peer))
    wait_for(lambda: decode.pages_used() > 0 and prefill.pages_used() > 0, 15,
             "both pools holding the room", interval=0.1)
    prefill.kill()
    t.join(30)
    assert box["r"].status_code == 503, box["r"].text
    assert box["r"].json()["error"]["code"] == "prefill_unavailable"
    wait_for(lambda: decode.pages_used() == 0, 15, "decode pool back to zero", interval=0.1)


def test_kill_decode_mid_transfer_prefill_frees(pd) -> None:
    prefill, decode, peer = pd
    t, box = in_background(lambda: _swallow(lambda: post(decode, peer)))
    wait_for(lambda: prefill.pages_used() > 0, 15, "prefill holding the room", interval=0.1)
    decode.kill()
    t.join(30)
    wait_for(lambda: prefill.pages_used() == 0, 15, "prefill pool back to zero", interval=0.1)


def test_client_disconnect_mid_transfer_aborts_with_ack(pd) -> None:
    prefill, decode, peer = pd
    t, box = in_background(lambda: _swallow(lambda: post(decode, peer, timeout=1.0)))
    t.join(10)  # the client gave up after 1 s, inside the 3 s stall
    wait_for(lambda: prefill.pages_used() == 0 and decode.pages_used() == 0, 15,
             "both pools back to zero", interval=0.1)
    counters = httpx.get(f"{decode.url}/pd/info", headers=OPERATOR).json()["counters"]
    assert counters.get("aborts_sent") == 1 and counters.get("transfers_committed", 0) == 0
    r = post(decode, peer)  # the connection is still good for the next request
    assert r.status_code == 200


def _swallow(fn):
    try:
        return fn()
    except httpx.HTTPError as e:
        return e
