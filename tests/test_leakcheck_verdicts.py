"""leakcheck ends every run with a verdict: exit 1 only for what it saw (a leak, a status wrong on
its face, a cache shared across tenants), never for its own failure or a server's legitimate
refusal of a feature. Property tests feed the report and the exit code every partial shape a
run can leave (no samples, one arm, no confidence interval, requests that time out, a server
that closes mid-run) through the real code; a sound server worded as vLLM 0.32 gives 0 or 2.
The timing probe's prompts come from the server's own vocabulary: under a word-level tokenizer
the control sees caching, and its twin (random base32 words, the old prompts) does not."""

from __future__ import annotations

import asyncio
import io
import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from checkpoints import word_level_checkpoint
from conftest import TINY_MODEL
from fake_openai import KEYS, NO_CHAT_TEMPLATE, CachingServer, WordingServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.role import UnifiedService
from kvfence.server.api import build_app
from kvfence.tools.canary import Leak
from kvfence.tools.leakcheck import (
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    Reply,
    Report,
    Settings,
    Tenant,
    check,
    judge_status,
    render_summary,
    timing_prompts,
)
from kvfence.tools.leakcheck import cli as leakcheck_cli
from kvfence.tools.leakcheck.api import Api
from kvfence.tools.leakcheck.cases import Kind, State
from kvfence.tools.leakcheck.judge import Outcome
from kvfence.tools.leakcheck.report import build_report
from kvfence.tools.leakcheck.run import Run, Target
from kvfence.tools.leakcheck.timing_result import ArmResult, Decision, TimingResult
from kvfence.tools.leakcheck.timing_stats import ArmStats
from kvfence.tools.leakcheck.wording import FEATURE_REFUSALS, WORDINGS

TENANTS = tuple(Tenant(t, k) for k, t in KEYS.items())
CODES = {EXIT_CLEAN, EXIT_FAILED, EXIT_CANNOT_RUN}


def _check(handler: Any, **kw: Any) -> Report:
    s = Settings(base_url="http://fake:8000", tenants=TENANTS, progress=False, **kw)
    return asyncio.run(check(s, transport=httpx.MockTransport(handler), err=io.StringIO()))


def _saw(report: Report) -> bool:
    """What alone may make exit 1: a leak, a wrong status, a timing finding."""
    t = report.totals
    timing = report.timing is not None and report.timing.decision is Decision.FINDING
    return bool(t.leaks or t.wrong_statuses or timing)


def _whole(report: Report) -> None:
    """The summary and the JSON report render, and the exit code is one of three."""
    assert report.exit_code in CODES
    assert f"(exit {report.exit_code})" in render_summary(report)
    doc = json.loads(json.dumps(report.as_dict()))
    assert doc["exit_code"] == report.exit_code
    assert (report.exit_code == EXIT_FAILED) == _saw(report), render_summary(report)


# ---- a sound server in vLLM 0.32's words ---------------------------------------------------------


@pytest.mark.parametrize("tokenize", [True, False])
@pytest.mark.parametrize("seed", [1, 2])
def test_sound_vllm_032_server_without_a_chat_template_exits_0_or_2(
    tokenize: bool, seed: int
) -> None:
    server = WordingServer("vllm-0.32", tokenize=tokenize, chat_template=False)
    report = _check(server.handle, requests=120, seed=seed, skip_probes=("timing",))
    _whole(report)
    assert report.exit_code in (EXIT_CLEAN, EXIT_CANNOT_RUN), render_summary(report)
    assert not report.findings, render_summary(report)
    refused_chat = [o for o in report.outcomes if o.endpoint == "chat" and o.reply.status == 400]
    assert refused_chat and all(o.wrong_status is None for o in refused_chat)
    assert any("chat completions unavailable" in n for n in report.notes)


def test_sound_vllm_032_server_with_the_default_probes_and_timing_exits_0_or_2() -> None:
    server = WordingServer("vllm-0.32", tokenize=True, chat_template=False)
    report = _check(server.handle, requests=200, seed=4)
    _whole(report)
    assert report.exit_code in (EXIT_CLEAN, EXIT_CANNOT_RUN), render_summary(report)


def test_feature_refusals_are_not_wrong_statuses_but_length_refusals_are() -> None:
    for _, message in FEATURE_REFUSALS:
        reply = Reply(400, error=message)
        assert judge_status(reply, 50, 16, 512, clear=True) is None, message
    for w in WORDINGS:  # every wording of a length refusal, for a request that fits
        reply = Reply(400, error=w.example)
        assert judge_status(reply, 50, 16, 512, clear=True) is not None, w.example
    # A 200 for an over-length prompt stays wrong on its face whatever the words.
    over = Reply(200, text="x", completion_tokens=5)
    assert judge_status(over, 600, 16, 512, clear=True) is not None


# ---- every partial shape a run can leave, through the real code ---------------------------------

BEHAVIOURS = (
    "ok", "ok", "ok", "close", "timeout", "500", "429", "garbage", "list_body", "feature",
    "cut_stream", "leak", "accept_over",
)  # fmt: skip


class ChaosServer:
    """A sound WordingServer, except that request i behaves as `script[i % len(script)]`:
    closes the connection, times out, answers 500 / 429 / garbage, refuses a feature, cuts a
    stream, answers with an earlier prompt's canary (a leak) or serves an over-length prompt
    (a wrong status). Only the last two may make leakcheck exit 1."""

    def __init__(self, script: list[str], tokenize: bool) -> None:
        self.script = script
        self.sound = WordingServer("vllm-0.32", tokenize=tokenize)
        self.accepting = WordingServer("vllm-0.32", tokenize=tokenize, ctx=1 << 20)
        self.i = 0
        self.previous = ""

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return self.sound.handle(request)
        what = self.script[self.i % len(self.script)]
        self.i += 1
        body = json.loads(request.content)
        text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        previous, self.previous = self.previous, text
        if what == "close":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        if what == "timeout":
            raise httpx.ReadTimeout("timed out")
        if what in ("500", "429"):
            return httpx.Response(int(what), json={"error": {"message": "busy"}})
        if what == "garbage":
            return httpx.Response(200, text="<html>proxy error</html>")
        if what == "list_body":
            return httpx.Response(200, json=[{"choices": "no"}, 3])
        if what == "feature":
            return httpx.Response(400, json={"error": {"message": NO_CHAT_TEMPLATE}})
        if what == "cut_stream":  # a sound answer whose stream breaks off in its first event
            r = self.sound.handle(request)
            if r.status_code == 200 and body.get("stream"):
                cut = r.content[: r.content.index(b"choices") + 12]
                return httpx.Response(200, content=cut, headers=r.headers)
            return r
        if what == "leak":
            m = re.search(r"^\S+: (\S+)$", previous, re.M)
            if m:
                answer = {"text": f" {m.group(1)}\n", "message": {"content": f" {m.group(1)}"}}
                usage = {"prompt_tokens": 10, "completion_tokens": 3}
                return httpx.Response(200, json={"choices": [answer], "usage": usage})
        if what == "accept_over":
            return self.accepting.handle(request)
        return self.sound.handle(request)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    script=st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=30),
    requests=st.integers(1, 70),
    probes=st.sampled_from([None, ("timing",), ("crosstalk",), ("admission", "timing")]),
    tokenize=st.booleans(),
    allow_incomplete=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_randomised_partial_runs_end_in_a_verdict(
    script: list[str],
    requests: int,
    probes: tuple[str, ...] | None,
    tokenize: bool,
    allow_incomplete: bool,
    seed: int,
) -> None:
    server = ChaosServer(script, tokenize)
    report = _check(
        server.handle,
        requests=requests,
        probes=probes,
        seed=seed,
        allow_incomplete=allow_incomplete,
        timing_pairs=8,
        timing_prefix_tokens=64,
        timeout=5.0,
    )
    _whole(report)
    if not {"leak", "accept_over"} & set(script):
        assert report.exit_code != EXIT_FAILED, render_summary(report)


def _stats(rng: random.Random) -> ArmStats:
    lo = rng.random()
    return ArmStats(
        pairs=rng.randint(8, 40),
        hit_median=rng.random(),
        fresh_median=rng.random(),
        auc=rng.random(),
        auc_ci=(lo, min(1.0, lo + rng.random())),
        ks_d=rng.random(),
        ks_p=rng.random(),
        detected=rng.random() < 0.3,
    )


def _outcome(rng: random.Random, i: int) -> Outcome:
    status = rng.choice([None, 200, 200, 400, 401, 429, 500, 307])
    reply = Reply(
        status,
        text=rng.choice(["", " abc\n"]),
        prompt_tokens=rng.choice([None, 10, 600]),
        completion_tokens=rng.choice([None, 0, 5]),
        error=rng.choice([None, "busy", NO_CHAT_TEMPLATE]),
        cancelled=rng.random() < 0.2,
    )
    out = Outcome(
        f"lc-{i}.1", f"lc-{i}", rng.choice(["setup", "crosstalk", "admission"]),
        rng.choice(["a", "b"]), rng.choice(["alpha", "beta"]), "completions",
        rng.random() < 0.5, rng.choice([None, 16]), reply.prompt_tokens, reply,
    )  # fmt: skip
    if rng.random() < 0.1:
        out.leaks = [Leak(out.request_id, "beta", "lc-0", "alpha", "CANARY", "CAN", False)]
    if rng.random() < 0.1:
        out.wrong_status = "HTTP 200 for an over-length request"
    return out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**32 - 1))
def test_any_partial_state_renders_with_a_consistent_exit_code(seed: int) -> None:
    """Run state as a run can leave it when stopped anywhere: no target, no outcomes, cases in
    every state, a timing result with no arms, one arm, arms without statistics."""
    rng = random.Random(seed)
    s = Settings(
        base_url="http://fake:8000",
        tenants=TENANTS,
        progress=False,
        probes=rng.choice([None, ("timing",)]),
        allow_incomplete=rng.random() < 0.5,
    )
    run = Run(s, Api("http://fake:8000", 1.0), io.StringIO())
    if rng.random() < 0.8:
        run.target = Target("m", 512, "server", list(TENANTS), chat=rng.random() < 0.5)
    for i in range(rng.randint(0, 12)):
        out = _outcome(rng, i)
        run.tallies.setdefault(out.probe, type(run.tallies["setup"])())
        run._record(out)
    for i in range(rng.randint(0, 6)):
        probe = rng.choice(["setup", "admission", "crosstalk", "timing", "cancellation"])
        kind = rng.choice(list(Kind))
        run.cases.plan(probe, f"case {i}", kind)
        if rng.random() < 0.5:
            run.cases.record(probe, f"case {i}", kind, rng.random() < 0.5, "no answer")
        if rng.random() < 0.3:
            run.cases.force(probe, f"case {i}", kind, rng.choice(list(State)), "forced")
    if rng.random() < 0.6:
        arms = tuple(
            ArmResult(
                f"arm {k}",
                "alpha",
                "beta",
                None,
                k == 0,
                tuple(rng.random() for _ in range(rng.randint(0, 9))),
                tuple(rng.random() for _ in range(rng.randint(0, 9))),
                _stats(rng) if rng.random() < 0.5 else None,
            )  # fmt: skip
            for k in range(rng.randint(0, 3))
        )
        run.timing = TimingResult(
            64, "whole request", "base32", 0.01, 0.6, rng.choice(list(Decision)), "v", arms,
            power=rng.choice([None, 0.5, 0.99]),
        )  # fmt: skip
    cannot = rng.choice([None, None, "unreachable"])
    internal = rng.choice([None, None, "KeyError: 'auc_ci'"])
    report = build_report(s, run, 0.0, cannot, internal)
    _whole(report)
    if internal and not _saw(report):
        assert report.exit_code == EXIT_CANNOT_RUN and "internal error" in render_summary(report)


def test_leakchecks_own_failure_is_exit_2_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a probe (here: the summary's old KeyError) ends INCOMPLETE, exit 2, never 1."""

    async def broken(run: Run) -> None:
        raise KeyError("auc_ci")

    monkeypatch.setattr(leakcheck_cli, "run_all", broken)
    report = _check(WordingServer("vllm-0.32").handle, requests=10)
    assert report.exit_code == EXIT_CANNOT_RUN and report.verdict.value == "incomplete"
    assert "KeyError: 'auc_ci'" in render_summary(report)
    out = io.StringIO()
    monkeypatch.setattr(leakcheck_cli, "render_summary", lambda r: {}["auc_ci"])
    assert leakcheck_cli.finish(report, out) == EXIT_CANNOT_RUN
    assert "internal error" in out.getvalue()


# ---- timing prompts from the server's own vocabulary ---------------------------------------------

TIMING = {"timing_prefix_tokens": 320, "timing_pairs": 12, "probes": ("timing",)}


def test_word_level_server_primes_and_fresh_prompts_differ_and_caching_is_seen() -> None:
    server = CachingServer(per_token_s=0.00025, word_level=True)
    with server.measured_by():
        report = _check(server.handle, requests=120, seed=3, **TIMING)
    timing = report.timing
    assert timing is not None, render_summary(report)
    assert "vocabulary" in timing.prompts, timing.prompts
    assert timing.control_saw_caching and timing.decision is Decision.CLEAN, render_summary(report)
    assert report.exit_code == EXIT_CLEAN


def test_twin_base32_prompts_on_a_word_level_server_see_no_caching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The old prompts: base32 words, all the unknown token here, so "fresh" is the primed one."""

    async def base32(run: Run, tenant: Tenant) -> timing_prompts.Prompts:
        return timing_prompts.Prompts(None, None, False, "random base32 words, unchecked")

    monkeypatch.setattr("kvfence.tools.leakcheck.timing.make_prompts", base32)
    server = CachingServer(per_token_s=0.00025, word_level=True)
    with server.measured_by():
        report = _check(server.handle, requests=120, seed=3, **TIMING)
    timing = report.timing
    assert timing is not None and not timing.control_saw_caching, render_summary(report)
    assert "no prefix caching detected" in timing.verdict
    assert report.exit_code == EXIT_CANNOT_RUN


def test_differ_from_first() -> None:
    assert timing_prompts.differ_from_first([5, 6], [7, 6])
    assert not timing_prompts.differ_from_first([0, 0], [0, 1])  # the unknown token twice
    assert timing_prompts.differ_from_first([1, 5], [1, 7], lead=1)  # past a BOS
    assert not timing_prompts.differ_from_first([], [1])


def test_prompts_from_a_word_level_kvfence_differ_as_tokens(tmp_path: Path) -> None:
    """Against kvfence's own /tokenize and /detokenize (in process) of a word-level checkpoint:
    base32 words are all the unknown token there, so the prompts come from its vocabulary, and
    a primed and a fresh prompt differ from their first token on."""
    model = word_level_checkpoint(tmp_path / "wordlevel", TINY_MODEL)
    cfg = EngineConfig(model=str(model), kv_pool_tokens=4096, context_length=2048)
    engine = Engine(cfg)
    engine.start()
    try:
        app = build_app(UnifiedService(engine), api_keys=None)

        async def go() -> tuple[object, list[list[int]]]:
            api = Api("http://kvfence", 30.0, httpx.ASGITransport(app))
            s = Settings(base_url="http://kvfence", tenants=TENANTS[:1], progress=False, seed=1)
            run = Run(s, api, io.StringIO())
            made = await timing_prompts.make_prompts(run, TENANTS[0])
            assert isinstance(made, timing_prompts.Prompts), made
            pair = await timing_prompts.fresh_pair(run, TENANTS[0], made, 256, 1.0)
            assert pair is not None
            ids = [await api.token_ids(TENANTS[0], t) or [] for t in pair]
            base32 = await api.token_ids(TENANTS[0], "AB12CD EF34GH JK56MN")
            await api.close()
            return made, [*ids, base32 or []]

        made, (primed, fresh, base32) = asyncio.run(go())
    finally:
        engine.shutdown()
    assert set(base32) == {0}  # the old prompts: every word the unknown token
    assert isinstance(made, timing_prompts.Prompts) and "vocabulary" in made.how
    assert primed[0] != fresh[0] and 0 not in primed + fresh
    assert 200 <= len(primed) <= 300 and len(set(primed)) > 100
