"""`kvfence leakcheck`: clean (exit 0) against kvfence with its guards on, PD and unified; exit 1
naming the probe and the request when answers carry other requests' canaries or over-length
requests are served; exit 2 when it cannot run. Fake servers cover what needs no engine."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from conftest import TINY_MODEL
from procs import Proc, free_port

from kvfence.tools import leakcheck
from kvfence.tools.cluster import LocalCluster
from kvfence.tools.leakcheck import (
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    Reply,
    Report,
    Settings,
    Tenant,
    api_root,
    check,
    count_from_error,
    judge_status,
    pick_model,
    render_summary,
)

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
TENANTS = tuple(Tenant(t, k) for k, t in KEYS.items())
FAULTS = "placeholder_on_reject,skip_count_check,skip_checksum,skip_tag_check"


# ---- a fake OpenAI server: a perfect recall model, optionally with the incident's bugs ---------


class FakeServer:
    """Answers `key:` cues from its prompt. `leak_over` > 0: prompts longer than that are
    answered from the previous request's prompt (decode reading stale pages after a placeholder
    swap); `accept_over`: over-length prompts get a 200 (no admission)."""

    CTX = 512

    def __init__(self, *, leak_over: int = 0, accept_over: bool = False, ctx_field: bool = True):
        self.leak_over = leak_over
        self.accept_over = accept_over
        self.ctx_field = ctx_field
        self.previous = ""
        self.seen = 0

    @staticmethod
    def tokens(text: str) -> int:
        return len(text) // 2 + 1

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization", "").removeprefix("Bearer ") not in KEYS:
            return httpx.Response(401, json={"error": {"message": "bad key", "code": "auth"}})
        if request.url.path == "/v1/models":
            card: dict[str, Any] = {"id": "fake"}
            if self.ctx_field:
                card["max_model_len"] = self.CTX
            return httpx.Response(200, json={"data": [card]})
        if request.url.path not in ("/v1/completions", "/v1/chat/completions"):
            return httpx.Response(404, json={"error": {"message": "no route"}})
        self.seen += 1
        body = json.loads(request.content)
        chat = "messages" in body
        text = body["messages"][0]["content"] if chat else body["prompt"]
        n = self.tokens(text)
        max_tokens = body.get("max_tokens", 16)
        if n + max_tokens > self.CTX and not self.accept_over:
            msg = f"maximum context length is {self.CTX} tokens. Your prompt has {n} tokens"
            return httpx.Response(400, json={"error": {"message": msg, "code": "ctx"}})
        cue = text.rsplit("\n", 1)[-1].removesuffix(":")
        m = re.search(rf"^{re.escape(cue)}: (\S+)$", text, re.M)
        if self.leak_over and n > self.leak_over:  # copies what the stale pages hold
            m = re.search(r"code: (\S+)$", self.previous, re.M)
        self.previous = text
        answer = f" {m.group(1)}\n" if m else " nothing\n"
        usage = {"prompt_tokens": n, "completion_tokens": min(max_tokens, 12)}
        if body.get("stream"):
            key = "delta" if chat else "text"
            piece = {"content": answer} if chat else answer
            events = [{"id": "x", "choices": [{key: piece}]}, {"choices": [], "usage": usage}]
            sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        choice = {"message": {"content": answer}} if chat else {"text": answer}
        return httpx.Response(200, json={"id": "x", "choices": [choice], "usage": usage})


def run_fake(server: FakeServer, requests: int = 80, **kw: Any) -> Report:
    # The timing probe (default with two tenants) has its own tests against a caching fake.
    kw.setdefault("skip_probes", ("timing",))
    settings = Settings(
        base_url="http://fake:8000/v1", tenants=TENANTS, requests=requests, seed=3, **kw
    )
    transport = httpx.MockTransport(server.handle)
    return asyncio.run(check(settings, transport=transport, err=io.StringIO()))


def test_fake_honest_server_is_clean_with_every_request_counted() -> None:
    server = FakeServer()
    report = (rep := run_fake(server, requests=90)).as_dict()
    assert report["exit_code"] == EXIT_CLEAN and report["verdict"] == "clean", report["findings"]
    assert report["totals"]["requests"] == server.seen == 90 == len(report["requests"])
    assert set(report["probes"]) == {
        "setup",
        "admission",
        "crosstalk",
        "stale_bait",
        "cancellation",
    }
    assert all(report["probes"][p]["requests"] > 0 for p in report["probes"])
    assert report["totals"]["echoed_own"] > 30  # the probes could have seen a leak
    assert report["target"]["context_length"] == 512
    assert report["target"]["context_length_source"] == "server"
    assert "verdict: CLEAN (exit 0)" in render_summary(rep)


def test_fake_stale_page_server_is_caught_naming_probe_and_request() -> None:
    report = (rep := run_fake(FakeServer(leak_over=300), requests=90)).as_dict()
    assert report["exit_code"] == EXIT_FAILED and report["verdict"] == "leak"
    leaks = [f for f in report["findings"] if f["kind"] == "leak"]
    assert leaks and {f["probe"] for f in leaks} & {"stale_bait", "admission", "cancellation"}
    f = leaks[0]
    ids = {r["request_id"] for r in report["requests"]}
    assert f["request_id"] in ids and f["owner_request_id"] != f["request_id"].split(".")[0]
    assert f["fragment"] in f["canary"] and f["status"] == 200
    assert "LEAK [" in render_summary(rep)


def test_fake_server_without_admission_is_a_wrong_status() -> None:
    report = run_fake(FakeServer(accept_over=True), requests=60).as_dict()
    assert report["exit_code"] == EXIT_FAILED and report["verdict"] == "wrong_status"
    cases = {f["case"] for f in report["findings"] if f["kind"] == "wrong_status"}
    assert {"N+1", "2N"} <= cases


def test_no_context_length_is_exit_2_unless_given() -> None:
    report = run_fake(FakeServer(ctx_field=False)).as_dict()
    assert report["exit_code"] == EXIT_CANNOT_RUN and "--context-length" in report["reason"]
    # 60, not 30: one pass over every case needs ~45 requests, and fewer is INCOMPLETE now.
    report = run_fake(FakeServer(ctx_field=False), requests=60, context_length=512).as_dict()
    assert report["exit_code"] == EXIT_CLEAN and report["target"]["context_length_source"] == "flag"


def test_every_key_refused_is_exit_2() -> None:
    settings = Settings(base_url="http://fake:8000", tenants=(Tenant("x", "nope"),), requests=5)
    transport = httpx.MockTransport(FakeServer().handle)
    report = asyncio.run(check(settings, transport=transport, err=io.StringIO())).as_dict()
    assert report["exit_code"] == EXIT_CANNOT_RUN and "refused" in report["reason"]


def test_unreachable_server_is_exit_2_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    cmd = [
        sys.executable,
        "-m",
        "kvfence.tools.leakcheck",
        "--base-url",
        f"http://127.0.0.1:{free_port()}",
        "--api-key",
        "k",
        "--report",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_CANNOT_RUN, proc.stderr
    assert "unreachable" in proc.stdout
    report = json.loads(out.read_text())
    assert report["verdict"] == "could_not_run" and report["totals"]["requests"] == 0


def test_redirects_to_other_hosts_are_not_followed() -> None:
    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return httpx.Response(307, headers={"location": "http://elsewhere:9/v1/models"})

    settings = Settings(base_url="http://fake:8000", tenants=TENANTS, requests=5)
    report = asyncio.run(
        check(settings, transport=httpx.MockTransport(handler), err=io.StringIO())
    ).as_dict()
    assert report["exit_code"] == EXIT_CANNOT_RUN and set(hosts) == {"fake"}


def test_discovery_parsing() -> None:
    assert api_root("http://h:8000/v1/") == api_root("http://h:8000") == "http://h:8000"
    assert pick_model({"data": [{"id": "m", "max_model_len": 4096}, {"id": "n"}]}, None) == (
        "m",
        4096,
    )
    assert pick_model({"data": [{"id": "m"}, {"id": "n", "context_length": 77}]}, "n") == ("n", 77)
    assert pick_model({"data": [{"id": "m", "max_context_length": 9}]}, None) == ("m", 9)
    assert pick_model({"data": []}, None) == (None, None)
    assert pick_model("junk", "w") == ("w", None)
    assert pick_model({"data": [{"id": "m", "max_model_len": True}]}, None) == ("m", None)


def test_count_from_error_messages_of_common_servers() -> None:
    kvfence = (
        "This model's maximum context length is 1024 tokens. However, your prompt has "
        "1309 tokens, leaving no room for a completion."
    )
    vllm = (
        "This model's maximum context length is 4096 tokens. However, you requested 5000 "
        "tokens (4984 in the messages, 16 in the completion)."
    )
    assert count_from_error(kvfence) == 1309 and count_from_error(vllm) == 4984
    assert count_from_error("rate limited") is None


def test_judge_status_boundaries() -> None:
    ok = Reply(200, text="x", completion_tokens=1)

    def j(reply: Reply, p: int, m: int | None) -> str | None:
        return judge_status(reply, p, m, 100, clear=True)

    assert j(ok, 99, 1) is None and j(Reply(400), 101, 1) is None
    assert "within the advertised context" in (j(Reply(400, error="pool"), 99, 1) or "")
    assert "over-length" in (j(ok, 101, 16) or "")
    assert "over-length" in (j(ok, 100, None) or "")
    assert j(Reply(200, completion_tokens=0), 100, None) is None  # nothing past N computed
    assert j(Reply(200, text="abc", completion_tokens=3), 90, 20) is None  # clamped max_tokens
    assert j(Reply(503), 101, 1) is None and j(Reply(None), 101, 1) is None
    assert judge_status(ok, 101, 16, 100, clear=False) is None


# ---- against kvfence itself ---------------------------------------------------------------------


class Up(LocalCluster):
    """`kvfence up` with the bundled model and both test tenants."""

    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        super().__init__(tmp, TINY_MODEL, *extra, keys=KEYS, env=env, startup_timeout=180)


def leakcheck_main(url: str, tmp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    report = tmp / "report.json"
    args = ["--base-url", url, "--report", str(report), "--seed", "5", "--no-progress"]
    # Until kvfence has a prefix cache the timing probe can only say "no caching detected";
    # its kvfence runs follow the prefix-cache issue.
    args += ["--skip-probe", "timing"]
    for key in KEYS:
        args += ["--api-key", key]
    code = leakcheck.main([*args, *extra])
    return code, json.loads(report.read_text())


def test_kvfence_pd_with_guards_on_is_clean(tmp_path: Path) -> None:
    up = Up(tmp_path, "--context-length", "1024", "--kv-pool-tokens", "8192")
    try:
        code, report = leakcheck_main(up.url, tmp_path, "--requests", "200")
    finally:
        up.stop()
    assert code == EXIT_CLEAN, (report["findings"], report["errors"])
    totals = report["totals"]
    assert totals["requests"] >= 200 and totals["leaks"] == totals["wrong_statuses"] == 0
    assert totals["errors"] == 0 and totals["echoed_own"] > 100
    assert report["probes"]["admission"]["refused"] >= 4  # N, N+1 (3 ways), 2N, just over


def test_kvfence_pd_incident_faults_leak_and_are_caught(tmp_path: Path) -> None:
    """The incident: a prefill pool smaller than the context, the placeholder swap, and the
    count/checksum/tag guards off. Its twin above is the same cluster with guards on."""
    env = {"KVFENCE_FAULT_INJECTION": "1", "KVFENCE_FAULTS": FAULTS}
    up = Up(
        tmp_path,
        "--context-length",
        "1024",
        "--kv-pool-tokens",
        "8192",
        "--prefill-kv-pool-tokens",
        "512",
        "--unsafe-skip-preflight",
        env=env,
    )
    try:
        code, report = leakcheck_main(up.url, tmp_path, "--requests", "120")
    finally:
        up.stop()
    assert code == EXIT_FAILED
    leaks = [f for f in report["findings"] if f["kind"] == "leak"]
    assert leaks, report["findings"]
    assert {f["probe"] for f in leaks} <= set(leakcheck.PROBES)
    ids = {r["request_id"] for r in report["requests"]}
    assert all(f["request_id"] in ids and f["owner_request_id"] for f in leaks)


def test_kvfence_unified_serve_is_clean(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("".join(f"{k} {t}\n" for k, t in KEYS.items()))
    port = free_port()
    node = Proc(
        [
            "serve",
            "--model",
            str(TINY_MODEL),
            "--port",
            str(port),
            "--context-length",
            "1024",
            "--kv-pool-tokens",
            "8192",
            "--api-key-file",
            str(keyfile),
            "--log-level",
            "warning",
        ],
        port,
        tmp_path / "serve.log",
    )
    try:
        node.wait_healthy()
        code, report = leakcheck_main(node.url, tmp_path, "--requests", "80")
    finally:
        node.stop()
    assert code == EXIT_CLEAN, (report["findings"], report["errors"])
    assert report["totals"]["requests"] == 80 and report["totals"]["errors"] == 0
