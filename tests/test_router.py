"""The PD router against fake workers: forwarding, the prefill header, auth, health, pairing,
error and stream pass-through (I5), and hang-ups reaching the decode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_workers import FakeState, ServerThread, free_port, make_app, stop_all
from waiting import wait_for

from kvfence.server import router as router_mod
from kvfence.server.router import (
    Role,
    RouterState,
    WorkerPool,
    build_router_app,
)
from kvfence.server.router.relay import _SSECutter

KEY = "sk-tenant-a"


class Cluster:
    def __init__(self) -> None:
        self.servers: list[ServerThread] = []

    def worker(self, role: str) -> tuple[str, FakeState]:
        bootstrap = free_port() if role == "prefill" else None
        app = make_app(role, f"{role}-{len(self.servers)}", bootstrap_port=bootstrap)
        s = ServerThread(app).start()
        self.servers.append(s)
        return s.url, app.state.fake

    def router(self, prefill: list[str], decode: list[str], **kw: Any) -> tuple[str, RouterState]:
        kw.setdefault("api_keys", None)
        app = build_router_app(prefill, decode, **kw)
        s = ServerThread(app).start()
        self.servers.append(s)
        return s.url, app.state.router

    def stop(self, url: str) -> None:
        for s in self.servers:
            if s.url == url:
                s.stop()


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    yield c
    stop_all(c.servers)


@pytest.fixture
def pair(cluster: Cluster) -> tuple[str, FakeState, FakeState, RouterState]:
    p_url, prefill = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    url, state = cluster.router([p_url], [d_url])
    return url, prefill, decode, state


def post(url: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=5, **kw)


def sse_events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e]


# ---- forwarding --------------------------------------------------------------------------------


def test_forwards_body_and_auth_unchanged_and_sets_prefill(pair) -> None:
    url, prefill, decode, _ = pair
    raw = b'{ "prompt":  "hi",\n "model": "m", "max_tokens": 3 }'
    r = httpx.post(url + "/v1/completions", content=raw, timeout=5, headers={
        "Content-Type": "application/json",
        "Authorization": "Bearer whatever-the-client-sent",
        "X-Kvfence-Room": "0" * 32,
        "X-Kvfence-Prefill": "evil.example:1",
        "X-Kvfence-Tenant": "someone-else",
    })
    assert r.status_code == 200, r.text
    assert r.json()["worker"] == "decode-1"
    assert prefill.requests == []  # the router talks to decode only
    (seen,) = decode.requests
    assert seen["body"] == raw
    h = seen["headers"]
    assert h["authorization"] == "Bearer whatever-the-client-sent"
    assert "x-kvfence-room" not in h  # decode mints the room; a client's never travels on
    assert h["x-kvfence-prefill"] == f"127.0.0.1:{prefill.bootstrap_port}"
    assert "x-kvfence-tenant" not in h


def test_chat_route_is_forwarded_to_the_same_path(pair) -> None:
    url, _, decode, _ = pair
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=5)
    assert r.status_code == 200
    assert decode.requests[0]["path"] == "/v1/chat/completions"


def test_responses_route_is_forwarded_to_the_same_path(pair) -> None:
    url, _, decode, _ = pair
    r = httpx.post(url + "/v1/responses", json={"model": "m", "input": "hi"}, timeout=5)
    assert r.status_code == 200
    (seen,) = decode.requests
    assert seen["path"] == "/v1/responses" and "x-kvfence-prefill" in seen["headers"]


def test_models_are_proxied_from_a_decode(pair) -> None:
    url, _, decode, _ = pair
    r = httpx.get(url + "/v1/models", timeout=5)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "fake-model"
    assert "x-kvfence-room" not in decode.requests[0]["headers"]


# ---- errors and streams (I5) -------------------------------------------------------------------


def test_i5_4xx_passes_through_unchanged(pair) -> None:
    url, _, _, _ = pair
    r = post(url, {"prompt": "error400"})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "This model's maximum context length is 4096 tokens.",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded",
    }}


def test_sse_passes_through_chunk_by_chunk(pair) -> None:
    url, _, decode, _ = pair
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "gated", "stream": True},
                      timeout=5) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_raw()
        first = next(chunks)
        # The decode is still holding its second event: the first arrived unbuffered.
        assert json.loads(first.removeprefix(b"data: "))["choices"][0]["text"] == "one"
        assert not decode.gate.is_set()
        decode.gate.set()
        rest = b"".join(chunks)
    assert sse_events((first + rest).decode())[1:] == [
        json.dumps({"object": "text_completion", "worker": "decode-1",
                    "choices": [{"index": 0, "text": " two"}]}),
        "[DONE]",
    ]


def test_i5_midstream_death_ends_with_an_error_event_not_done(pair) -> None:
    url, _, _, state = pair
    r = post(url, {"prompt": "die", "stream": True})
    assert r.status_code == 200  # the status line left with the first token
    events = sse_events(r.text)
    assert json.loads(events[0])["choices"][0]["text"] == "one"
    assert json.loads(events[-1])["error"]["code"] == "upstream_failed"
    assert "[DONE]" not in events
    assert state.decode.workers[0].in_flight == 0


def test_i5_nonstream_death_is_a_502_with_an_openai_body(pair) -> None:
    url, _, _, _ = pair
    r = post(url, {"prompt": "die-json"})
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_failed"
    assert r.json()["error"]["type"] == "server_error"


def test_sse_cutter_holds_half_events_and_knows_a_clean_end() -> None:
    c = _SSECutter()
    assert c.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert not c.ended_cleanly  # half an event is pending
    assert c.feed(b": 2}\n\n") == b'data: {"b": 2}\n\n'
    assert not c.ended_cleanly  # no [DONE] yet
    c.feed(b"data: [DONE]\n\n")
    assert c.ended_cleanly
    err = _SSECutter()
    err.feed(b'data: {"error": {"message": "x"}}\r\n\r\n')
    assert err.ended_cleanly  # the worker's own error event is an end


def test_sse_cutter_knows_the_end_of_a_responses_stream() -> None:
    """A Responses API stream has no [DONE]: response.completed (named as the event) ends it;
    a stream cut after a delta does not read as complete (I5)."""
    c = _SSECutter()
    c.feed(b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}\n\n')
    assert not c.ended_cleanly
    c.feed(b'event: response.completed\ndata: {"type": "response.completed"}\n\n')
    assert c.ended_cleanly
    unnamed = _SSECutter()
    unnamed.feed(b'data: {"type": "response.completed"}\n\n')
    assert not unnamed.ended_cleanly  # the worker names every Responses event


# ---- auth --------------------------------------------------------------------------------------


def test_i6_bad_key_gets_401_at_the_router_without_touching_workers(cluster: Cluster) -> None:
    p_url, _ = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    url, _ = cluster.router([p_url], [d_url], api_keys={KEY: "tenant-a"})
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        r = post(url, {"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 401
    assert decode.requests == []
    r = post(url, {"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    assert decode.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"


# ---- health and pairing ------------------------------------------------------------------------


def test_dead_decode_is_out_of_rotation(cluster: Cluster) -> None:
    p_url, _ = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    dead = f"http://127.0.0.1:{free_port()}"
    url, _ = cluster.router([p_url], [dead, d_url])
    for _ in range(4):
        assert post(url, {"prompt": "x"}).status_code == 200
    assert len(decode.requests) == 4
    health = httpx.get(url + "/health", timeout=5).json()
    by_url = {w["url"]: w for w in health["workers"]}
    assert health["status"] == "ok"
    assert by_url[dead]["healthy"] is False and by_url[dead]["detail"]
    assert by_url[d_url]["healthy"] is True


def test_connect_failure_is_retried_once_on_another_decode(cluster: Cluster) -> None:
    p_url, _ = cluster.worker("prefill")
    a_url, _ = cluster.worker("decode")
    b_url, b = cluster.worker("decode")
    url, state = cluster.router([p_url], [a_url, b_url], health_interval=60)
    cluster.stop(a_url)  # the router still believes it healthy
    for _ in range(3):
        assert post(url, {"prompt": "x"}).status_code == 200
    assert len(b.requests) == 3
    assert state.decode.workers[0].healthy is False
    metrics = httpx.get(url + "/metrics", timeout=5).text
    assert "kvfence_router_retries_total 1.0" in metrics


def test_no_healthy_pair_is_503_no_workers(cluster: Cluster) -> None:
    p_url, _ = cluster.worker("prefill")
    dead = f"http://127.0.0.1:{free_port()}"
    url, _ = cluster.router([p_url], [dead])
    r = post(url, {"prompt": "x"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert (err["message"], err["type"], err["code"]) == (
        "no healthy prefill/decode workers", "server_error", "no_workers"
    )
    assert r.headers["retry-after"] == "1"  # the README's error table: retryable
    h = httpx.get(url + "/health", timeout=5)
    assert h.status_code == 503
    assert h.json()["error"]["code"] == "no_workers"
    assert [w["healthy"] for w in h.json()["workers"]] == [True, False]


def test_health_reports_a_workers_pairing_error_and_its_recovery(cluster: Cluster) -> None:
    p_url, _ = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    decode.healthy = False
    decode.health_error = "pairing refused: prefill page_size 32 != decode page_size 16"
    url, _ = cluster.router([p_url], [d_url], health_interval=0.05)
    h = httpx.get(url + "/health", timeout=5)
    assert h.status_code == 503
    (d,) = [w for w in h.json()["workers"] if w["role"] == "decode"]
    assert "page_size 32 != decode page_size 16" in d["detail"]
    decode.healthy = True
    wait_for(lambda: httpx.get(url + "/health", timeout=5).status_code == 200)
    assert post(url, {"prompt": "x"}).status_code == 200


def test_a_worker_in_the_wrong_role_is_never_paired(cluster: Cluster) -> None:
    d1_url, _ = cluster.worker("decode")
    d2_url, _ = cluster.worker("decode")
    url, _ = cluster.router([d1_url], [d2_url])  # a decode listed as prefill
    h = httpx.get(url + "/health", timeout=5)
    assert h.status_code == 503
    assert "says role 'decode'" in h.json()["workers"][0]["detail"]


# ---- load --------------------------------------------------------------------------------------


def test_least_loaded_pair_is_picked(cluster: Cluster) -> None:
    p0_url, p0 = cluster.worker("prefill")
    p1_url, p1 = cluster.worker("prefill")
    d0_url, d0 = cluster.worker("decode")
    d1_url, d1 = cluster.worker("decode")
    url, state = cluster.router([p0_url, p1_url], [d0_url, d1_url])
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "gated", "stream": True},
                      timeout=5) as r:
        chunks = r.iter_raw()
        next(chunks)  # one long answer now holds a prefill and a decode
        busy_d, idle_d = (d0, d1) if d0.requests else (d1, d0)
        busy_p = busy_d.requests[0]["headers"]["x-kvfence-prefill"]
        for _ in range(3):
            assert post(url, {"prompt": "x"}).json()["worker"] == idle_d.name
        for req in idle_d.requests:
            assert req["headers"]["x-kvfence-prefill"] != busy_p
        busy_d.gate.set()
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    assert len(busy_d.requests) == 1
    assert [w.in_flight for w in state.decode.workers + state.prefill.workers] == [0, 0, 0, 0]


def test_ties_go_round_robin() -> None:
    pool = WorkerPool(Role.DECODE, ["http://a:1", "http://b:2", "http://c:3"])
    for w in pool.workers:
        w.healthy = True
    assert [pool.pick().name for _ in range(4)] == [  # type: ignore[union-attr]
        "decode-0", "decode-1", "decode-2", "decode-0"
    ]
    pool.workers[0].in_flight = 1
    picks = {pool.pick().name for _ in range(4)}  # type: ignore[union-attr]
    assert picks == {"decode-1", "decode-2"}
    assert pool.pick(exclude=pool.workers[1:]) is pool.workers[0]
    pool.workers[0].healthy = False
    assert pool.pick(exclude=pool.workers[1:]) is None


# ---- hang-ups and time limits ----------------------------------------------------------------


def test_client_hangup_mid_stream_closes_the_decode_connection(pair) -> None:
    url, _, decode, state = pair
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "hang", "stream": True},
                      timeout=5) as r:
        next(r.iter_raw())
    wait_for(lambda: decode.disconnects == ["hang"])
    wait_for(lambda: state.decode.workers[0].in_flight == 0)


def test_client_hangup_before_the_first_byte_closes_the_decode_connection(pair) -> None:
    url, _, decode, state = pair
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "hold"}, timeout=0.3)
    wait_for(lambda: decode.disconnects == ["hold"])
    wait_for(lambda: state.decode.workers[0].in_flight == 0)


def test_request_timeout_bounds_a_whole_stream(cluster: Cluster) -> None:
    p_url, _ = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    url, _ = cluster.router([p_url], [d_url], request_timeout=0.4)
    events = sse_events(post(url, {"prompt": "hang", "stream": True}).text)
    assert json.loads(events[-1])["error"]["code"] == "upstream_timeout"
    assert "[DONE]" not in events
    r = post(url, {"prompt": "hold"})
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    wait_for(lambda: sorted(decode.disconnects) == ["hang", "hold"])


def test_metrics_count_requests_and_workers(pair) -> None:
    url, _, _, _ = pair
    post(url, {"prompt": "x"})
    post(url, {"prompt": "error400"})
    text = httpx.get(url + "/metrics", timeout=5).text
    assert 'kvfence_router_requests_total{path="/v1/completions",status="200"} 1.0' in text
    assert 'kvfence_router_requests_total{path="/v1/completions",status="400"} 1.0' in text
    assert 'kvfence_router_workers_healthy{role="decode"} 1.0' in text
    assert "kvfence_router_worker_in_flight{" in text


def test_model_lookups_keep_metric_labels_bounded(pair) -> None:
    url, _, _, _ = pair
    for name in ("a", "b"):
        httpx.get(f"{url}/v1/models/{name}", timeout=5)
    text = httpx.get(url + "/metrics", timeout=5).text
    assert 'path="/v1/models/{model_id:path}",status="404"} 2.0' in text


def test_router_command_refuses_bad_config(tmp_path, capsys) -> None:
    assert router_mod.main(["--prefill", "nope", "--decode", "http://a:1"]) == 1
    keys = tmp_path / "keys"
    keys.write_text("only-one-field\n")
    assert router_mod.main(["--prefill", "http://a:1", "--decode", "http://b:2",
                            "--api-key-file", str(keys)]) == 1
    err = capsys.readouterr().err
    assert "HOST:PORT" in err and "expected 'KEY TENANT'" in err


def test_build_rejects_bad_worker_lists() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        build_router_app(["localhost"], ["http://a:1"], api_keys=None)
    with pytest.raises(ValueError, match="twice"):
        build_router_app(["http://a:1"], ["http://a:1/"], api_keys=None)


def test_official_client_sees_answers_streams_and_errors(pair) -> None:
    openai = pytest.importorskip("openai")
    url, _, _, _ = pair
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-any", max_retries=0, timeout=5)
    answer = client.completions.create(model="m", prompt="x")
    assert answer.choices[0].text == "answer from decode-1"
    stream = client.completions.create(model="m", prompt="x", stream=True)
    texts = [c.choices[0].text for c in stream]
    assert texts == ["one", " two"]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="m", prompt="error400")
    assert bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIError, match="stopped before the answer was complete"):
        list(client.completions.create(model="m", prompt="die", stream=True))


# ---- the router relays only its own routes ------------------------------------------------------


TRAVERSALS = (
    "/v1/models/%2e%2e/%2e%2e/pd/info",
    "/v1/models/%2E%2E/%2E%2E/metrics",
    "/v1/models/..%2f..%2fpd%2finfo",
    "/v1/models/%2e%2e%2f%2e%2e%2fhealth",
    "/v1/models/fake-model/%2e%2e/%2e%2e/%2e%2e/pd/info",
)


def test_a_model_id_is_never_a_path_to_a_workers_internal_route(cluster: Cluster) -> None:
    # The attack: the decoded path was relayed, so a tenant read decode's /pd/info (room ids and
    # their timings) and /metrics (per-tenant counters) through the public router.
    p_url, _ = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    url, _ = cluster.router([p_url], [d_url], api_keys={KEY: "tenant-a"})
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in TRAVERSALS:
        r = httpx.get(url + path, headers=auth, timeout=5)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["code"] == "model_not_found", path
        assert "bootstrap" not in r.text and "role" not in r.text, path
    assert decode.requests == []
    # A real id, including an HF-style org/name, reaches the worker's model route as itself.
    r = httpx.get(f"{url}/v1/models/fake-model", headers=auth, timeout=5)
    assert r.status_code == 200 and r.json()["id"] == "fake-model", r.text
    r = httpx.get(f"{url}/v1/models/org/model-1.5_b", headers=auth, timeout=5)
    assert r.status_code == 404, r.text  # the worker's own answer: it serves another model
    assert [q["path"] for q in decode.requests] == [
        "/v1/models/fake-model", "/v1/models/org/model-1.5_b"
    ]


def test_i6_two_authorization_headers_are_refused_at_the_router(cluster: Cluster) -> None:
    # The router checked the first header and forwarded the last: tenant B's key reached decode
    # behind tenant A's check. Now neither hop accepts two.
    p_url, _ = cluster.worker("prefill")
    d_url, decode = cluster.worker("decode")
    url, _ = cluster.router([p_url], [d_url], api_keys={KEY: "tenant-a", "sk-b": "tenant-b"})
    two = [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer sk-b")]
    r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "x"},
                   headers=two, timeout=5)
    assert r.status_code == 400 and r.json()["error"]["code"] == "duplicate_authorization"
    assert httpx.get(url + "/v1/models", headers=two, timeout=5).status_code == 400
    assert decode.requests == []
