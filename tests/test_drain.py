"""Graceful drain (SIGTERM): readiness turns 503 at once, new requests get a 503 that says so (and
that the router may retry elsewhere), what was admitted finishes in full, what outlives
--drain-timeout ends in a clear error (never a partial 200), and the pool ends empty. The
rolling restart of a whole `kvfence up` under load is behind RUN_SLOW=1 at the end."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from api_client import MODEL, sse_data
from conftest import TINY_MODEL
from fake_engine import FakeEngine
from fake_workers import ServerThread, free_port, make_app, stop_all
from pd_harness import PDPair, Result, finished_ok
from procs import serve
from waiting import wait_for

from kvfence.engine.admission import Rejected
from kvfence.engine.request import SamplingParams
from kvfence.server.api import build_app
from kvfence.server.drain import NOT_ADMITTED_HEADER, Drain
from kvfence.server.errors import table_mismatch
from kvfence.server.router import build_router_app
from kvfence.tools.cluster import LocalCluster


@pytest.fixture
def held() -> Iterator[tuple[FakeEngine, Drain, ServerThread]]:
    engine = FakeEngine(hold=True)
    engine.start()
    drain = Drain(engine, timeout=0)
    server = ServerThread(build_app(engine, api_keys=None, drain=drain)).start()
    yield engine, drain, server
    server.stop()
    engine.shutdown()


def test_draining_node_is_unready_refuses_new_work_with_a_503_and_stays_live(held) -> None:
    engine, drain, server = held
    assert httpx.get(server.url + "/health").status_code == 200
    drain.begin()
    health = httpx.get(server.url + "/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
    assert httpx.get(server.url + "/live").status_code == 200  # a drain is not a hang
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "draining"
    # Refused at the door: the router may retry it elsewhere, and it held nothing here.
    assert r.headers[NOT_ADMITTED_HEADER] == "draining"
    assert engine.submitted == []


def test_what_outlives_the_drain_timeout_ends_in_an_error_never_a_partial_200(held) -> None:
    engine, drain, server = held
    engine.hold = False
    engine.step_delay = 0.01
    got: dict[str, object] = {"text": ""}
    started = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 500, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            got["status"] = r.status_code
            for chunk in r.iter_text():
                got["text"] = str(got["text"]) + chunk
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30), "the stream never started"
    asyncio.run(drain.run())  # timeout 0: abort at once
    t.join(30)
    assert got["status"] == 200  # its first token went out before the drain
    data = sse_data(str(got["text"]))
    assert "[DONE]" not in data
    assert json.loads(data[-1])["error"]["code"] == "request_aborted"
    assert engine.aborted == [engine.submitted[0].request_id]
    assert not drain.busy()


def test_router_retries_a_draining_decodes_refusal_on_another(held) -> None:
    _, drain, draining = held
    drain.begin()
    prefill = ServerThread(make_app("prefill", "prefill-0", bootstrap_port=free_port())).start()
    other = ServerThread(make_app("decode", "decode-1")).start()
    # The draining node says "unified" in /pd/info; the router's view is patched to a decode.
    app = build_router_app([prefill.url], [draining.url, other.url], api_keys=None)
    router = ServerThread(app).start()
    try:
        state = app.state.router
        first = state.decode.workers[0]
        first.healthy, first.info, first.detail = True, {"role": "decode"}, None
        state.decode.workers[1].in_flight = 1  # least-loaded pick: the draining one first
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200, r.text
        assert r.json()["worker"] == "decode-1"
        assert not first.healthy and "draining" in (first.detail or "")
        assert NOT_ADMITTED_HEADER.lower() not in r.headers
    finally:
        stop_all([router, prefill, other])


def test_router_relays_a_draining_decodes_503_with_its_retry_after(held) -> None:
    """Found by the cache-mix chaos soak: with no other decode to retry on, the router relayed
    the draining decode's 503 body without its Retry-After, against the error table."""
    _, drain, draining = held
    drain.begin()
    prefill = ServerThread(make_app("prefill", "prefill-0", bootstrap_port=free_port())).start()
    app = build_router_app([prefill.url], [draining.url], api_keys=None)
    router = ServerThread(app).start()
    try:
        only = app.state.router.decode.workers[0]
        only.healthy, only.info, only.detail = True, {"role": "decode"}, None
        r = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
        err = r.json()["error"]
        why = table_mismatch(503, err["code"], err["type"], r.headers.get("retry-after"))
        assert why is None, why
    finally:
        stop_all([router, prefill])


def test_pd_drain_refuses_new_rooms_with_a_503_and_finishes_admitted_ones() -> None:
    pair = PDPair(str(TINY_MODEL), kv_pool_tokens=2048, context_length=512,
                  attention_backend="torch", linear_backend="torch")
    try:
        tok = pair.decode.engine.tokenizer
        prompt = tok.encode("name: Ada\ncode: X7qPz91LmWk2\ncode:")
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        _, admitted = pair.submit(prompt, params)
        assert isinstance(admitted, Result)
        wait_for(lambda: admitted.token_ids, 60, "the admitted request never started decoding")
        pair.prefill.stop_admitting()
        # A new room: decode admits and reserves, prefill refuses it at its door with a 503.
        _, refused = pair.submit(prompt, params)
        assert isinstance(refused, Result) and refused.done.wait(60)
        assert refused.final is not None and refused.token_ids == []
        assert (refused.final.error_status, refused.final.error_code) == (503, "draining")
        pair.decode.stop_admitting()
        _, at_door = pair.submit(prompt, params)
        assert isinstance(at_door, Rejected) and (at_door.status, at_door.code) == (503, "draining")
        assert admitted.done.wait(60) and finished_ok(admitted)
        assert len(admitted.token_ids) == 24
        assert pair.wait_idle(), f"pages still held: {pair.pages_used()}"
        assert not Drain(pair.decode).busy() and not Drain(pair.prefill).busy()
    finally:
        pair.close()


@pytest.mark.parametrize("tp", [1, 2])
def test_sigterm_lets_admitted_streams_finish_then_exits(tmp_path: Path, tp: int) -> None:
    """With tp=2 the SIGTERM goes to the node's whole process group, as `kvfence up`'s rolling
    restart sends it: the follower rank must not die under the drain (it did: every admitted
    stream then ended in a 503 engine_failed)."""
    node = serve("null", tmp_path, "--context-length", "512", "--drain-timeout", "120",
                 "--tp-size", str(tp), own_group=tp > 1)
    try:
        node.wait_healthy()
        body = {"model": "kvfence-tiny", "prompt": "name: Ada\ncode: X7qPz91LmWk2\ncode:",
                "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
        first = [threading.Event() for _ in range(2)]
        texts: list[str] = ["", ""]

        def stream(i: int) -> None:
            with httpx.stream("POST", node.url + "/v1/completions", json=body, timeout=120) as r:
                for chunk in r.iter_text():
                    texts[i] += chunk
                    first[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for e in first:
            assert e.wait(60), "a stream never started"
        if tp > 1:
            os.killpg(node.p.pid, signal.SIGTERM)
        else:
            node.p.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(node.url + "/health").status_code == 503, 30,
                 "readiness did not turn 503 on SIGTERM")
        late = httpx.post(node.url + "/v1/completions", json={**body, "stream": False})
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        for t in threads:
            t.join(120)
        for text in texts:
            data = sse_data(text)
            assert data[-1] == "[DONE]", data[-3:]
            assert sum(1 for d in data[:-1] if json.loads(d)["choices"]) == 64
        assert node.p.wait(60) == 0
        log = node.log.read_text()
        assert re.search(r"drained in .*2 request\(s\) in flight at SIGTERM, 2 finished, "
                         r"0 aborted .*pages still held: 0", log), log[-2000:]
    finally:
        node.stop()


@pytest.mark.parametrize("prompt", ["prefill-draining", "prefill-gone"])
def test_router_takes_a_prefill_a_decode_reports_gone_out_of_rotation_at_once(prompt) -> None:
    prefills = [ServerThread(make_app("prefill", f"prefill-{i}", bootstrap_port=free_port()))
                .start() for i in range(2)]
    decode = make_app("decode", "decode-0")
    servers = [*prefills, ServerThread(decode).start()]
    app = build_router_app([p.url for p in prefills], [servers[-1].url], api_keys=None,
                           health_interval=3600)  # only the relay can take it out here
    servers.append(ServerThread(app).start())
    try:
        url, state = servers[-1].url, app.state.router
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt})
        assert r.status_code == 503  # it reached decode's engine: passed on, not retried
        gone = decode.state.fake.requests[-1]["headers"]["x-kvfence-prefill"]
        down = [w for w in state.prefill.workers if not w.healthy]
        assert [w.bootstrap for w in down] == [gone]
        for _ in range(3):
            ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert ok.status_code == 200
            assert decode.state.fake.requests[-1]["headers"]["x-kvfence-prefill"] != gone
    finally:
        stop_all(servers)


# ---- the rolling restart of `kvfence up` under load (slow) -------------------------------------


@pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="multi-process soak: RUN_SLOW=1")
def test_rolling_restart_under_load_loses_no_request(tmp_path: Path) -> None:
    keys = {"key-a": "tenant-a", "key-b": "tenant-b"}  # two tenants: a leak would show
    with LocalCluster(tmp_path, TINY_MODEL, "--prefill", "2", "--decode", "2",
                      "--context-length", "512", "--kv-pool-tokens", "4096",
                      "--drain-timeout", "60", keys=keys) as cluster:
        baseline = cluster.pages_used()
        results: list[tuple[int, str, int]] = []
        failures: list[str] = []
        stop = threading.Event()

        def client(i: int) -> None:
            body = {"model": "kvfence-tiny", "prompt": f"name: Ada\ncode: Q{i}x7Lm\ncode:",
                    "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 0}
            while not stop.is_set():
                try:
                    r = cluster.post(body, key=("key-a", "key-b")[i % 2])
                except httpx.HTTPError as e:  # a reset or a cut: exactly what must not happen
                    failures.append(f"{type(e).__name__}: {e}")
                    continue
                results.append((r.status_code, r.text, i))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: len(results) >= 8, 120, "no steady stream of answers")
        cluster.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "rolling restart done" in cluster.log.read_text(), 600,
                 lambda: cluster.log.read_text()[-3000:])
        n = len(results)
        wait_for(lambda: len(results) >= n + 8, 120, "no answers after the restart")
        stop.set()
        for t in threads:
            t.join(120)
        assert failures == []
        refusals: dict[str, int] = {}
        codes = [f"Q{i}x7Lm" for i in range(len(threads))]
        for status, text, i in results:
            if status == 503:
                # Clear 503s: a draining worker's door; a prefill that left before the router's
                # next health poll (the request reached decode's engine, so it is not retried).
                code = json.loads(text)["error"]["code"]
                assert code in ("draining", "no_workers", "prefill_unavailable"), text
                refusals[code] = refusals.get(code, 0) + 1
                continue
            assert status == 200, text
            if text.startswith("data: "):
                data = sse_data(text)
                assert data[-1] == "[DONE]"
                chunks = [json.loads(d)["choices"] for d in data[:-1]]
                assert sum(1 for c in chunks if c) == 12
                answer = "".join(c[0]["text"] for c in chunks if c)
            else:
                assert json.loads(text)["usage"]["completion_tokens"] == 12
                answer = json.loads(text)["choices"][0]["text"]
            # Zero leaks: the recall model answers with this client's code, never another's.
            assert codes[i] in answer, (i, answer)
            assert not [c for c in codes if c != codes[i] and c in answer], (i, answer)
        ok = sum(1 for s, _, _ in results if s == 200)
        print(f"rolling restart under load: {len(results)} answers, {ok} full, "
              f"{len(results) - ok} clear 503s {refusals}")
        wait_for(lambda: cluster.pages_used() == baseline, 60, "pages did not come back")
        assert all(w["healthy"] for w in cluster.workers())


@pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="three processes restarted: RUN_SLOW=1")
def test_up_sighup_restarts_each_worker_in_turn_and_keeps_serving(tmp_path: Path) -> None:
    from test_up import Up, alive

    up = Up(tmp_path, "--served-model-name", "demo")
    try:
        up.wait_line("kvfence up: ready on")
        before = up.pids()
        up.proc.send_signal(signal.SIGHUP)
        up.wait_line("kvfence up: rolling restart done", timeout=120)
        after = up.pids()
        restarted = [ln for ln in up.lines if "rolling restart: draining" in ln]
        assert [ln.split("draining ")[1].split()[0] for ln in restarted] == [
            "decode-0", "prefill-0"]  # decodes first, one at a time
        for name in ("decode-0", "prefill-0"):
            assert after[name] != before[name] and not alive(before[name])
        assert after["router"] == before["router"]
        r = httpx.post(f"http://127.0.0.1:{up.port}/v1/completions",
                       json={"model": "demo", "prompt": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["worker"].startswith("decode@")
        up.proc.send_signal(signal.SIGTERM)
        code, _ = up.finish()
        assert code == 0
        assert [n for n, pid in up.pids().items() if alive(pid)] == []
    finally:
        up.kill()
