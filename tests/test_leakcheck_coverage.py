"""leakcheck never passes what it did not check: against fake servers that refuse over-length
prompts in each supported wording (with and without `/tokenize`, with a tokenizer that disagrees
with leakcheck's estimate), every case is judged or reported as not run, and the exit code
follows (0 clean, 2 INCOMPLETE, 0 with --allow-incomplete)."""

from __future__ import annotations

import asyncio
import io
import random
from typing import Any

import httpx
import pytest
from fake_openai import KEYS, STYLES, TRUNCATING, WordingServer

from kvfence.tools.canary import (
    DEFAULT_CHARS_PER_TOKEN,
    CanaryRegistry,
    approx_counter,
    build_prompt,
)
from kvfence.tools.leakcheck import (
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    Report,
    Settings,
    Tenant,
    check,
    render_summary,
)
from kvfence.tools.leakcheck.wording import WORDINGS, parse_refusal

TENANTS = tuple(Tenant(t, k) for k, t in KEYS.items())
KNOWN = [s for s in STYLES if s != "unknown"]


def run(server: WordingServer, requests: int = 90, **kw: Any) -> Report:
    # The timing probe has its own tests (test_leakcheck_timing.py); these servers answer at once.
    kw.setdefault("skip_probes", ("timing",))
    settings = Settings(
        base_url="http://fake:8000", tenants=TENANTS, requests=requests, seed=7, **kw
    )
    transport = httpx.MockTransport(server.handle)
    return asyncio.run(check(settings, transport=transport, err=io.StringIO()))


def cases(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {f"{c['probe']}: {c['case']}": c for c in report["cases"]}


@pytest.mark.parametrize("style", KNOWN)
def test_each_wording_is_read_and_every_case_judged_without_a_tokenizer(style: str) -> None:
    report = (rep := run(WordingServer(style, tokenize=False))).as_dict()
    summary = render_summary(rep)
    assert report["verdict"] == "clean" and report["exit_code"] == EXIT_CLEAN, summary
    assert report["target"]["token_counts"] == "usage"
    by_case = cases(report)
    for name in ("N+1", "N+1 chat", "N+1 stream", "N, default max_tokens", "2N"):
        assert by_case[f"admission: {name}"]["state"] == "ran", (name, summary)
    assert all(c["state"] in ("ran", "not_applicable") for c in report["cases"]), summary
    refused = [r for r in report["requests"] if r["status"] == 400]
    assert refused, "no over-length request was refused"
    for r in refused:
        # The refusal is kept word for word, and the count it states is the server's.
        assert r["refusal"]["message"] and r["refusal"]["status"] == 400
        lower = style in TRUNCATING
        assert r["prompt_tokens_source"] == ("refusal (at least)" if lower else "refusal"), r
        assert r["judged"], r


def test_unknown_wording_without_a_tokenizer_is_incomplete_not_clean() -> None:
    report = (rep := run(WordingServer("unknown", tokenize=False))).as_dict()
    assert report["verdict"] == "incomplete" and report["exit_code"] == EXIT_CANNOT_RUN
    not_run = {k for k, c in cases(report).items() if c["state"] in ("skipped", "inconclusive")}
    # N+1 plain and streamed are sized from below (N-1 measured by usage, plus pad tokens); a
    # chat prompt adds a template of unknown length, and the refusal states no count.
    assert "admission: N+1 chat" in not_run and "admission: N+1" not in not_run, not_run
    assert cases(report)["admission: N+1"]["state"] == "ran"
    assert any("admission" in line for line in report["incomplete"])
    assert "verdict: INCOMPLETE (exit 2)" in render_summary(rep)
    # The same run with --allow-incomplete exits 0 and still says INCOMPLETE.
    report = (rep := run(WordingServer("unknown", tokenize=False), allow_incomplete=True)).as_dict()
    assert report["verdict"] == "incomplete" and report["exit_code"] == EXIT_CLEAN
    assert "INCOMPLETE" in render_summary(rep)


def test_unknown_wording_with_a_tokenizer_is_judged() -> None:
    """The tokenizer gives the counts the refusal does not: every case can be judged."""
    report = (rep := run(WordingServer("unknown", tokenize=True))).as_dict()
    assert report["verdict"] == "clean", render_summary(rep)
    assert report["target"]["token_counts"] == "server"


@pytest.mark.parametrize("tokenize", [True, False])
def test_over_length_bait_is_over_even_when_the_tokenizer_disagrees(tokenize: bool) -> None:
    # Long texts cost far fewer tokens per character than short ones on this server.
    server = WordingServer(
        "vllm-0.32", tokenize=tokenize, chars_per_token=1.5, long_chars_per_token=6.0
    )
    ctx = server.ctx
    # Sensitivity: sized by a guess alone, an "over-length" prompt comes out within the context.
    guess = build_prompt(
        CanaryRegistry(),
        "t",
        "r",
        ctx + 16,
        rng=random.Random(1),
        count_tokens=approx_counter(DEFAULT_CHARS_PER_TOKEN),
    )
    assert server.tokens(guess.text) + 32 <= ctx
    report = (rep := run(server, requests=120)).as_dict()
    assert report["verdict"] == "clean", render_summary(rep)
    bait = [r for r in report["requests"] if r["case"] == "over-length"]
    assert bait and any(r["status"] == 400 for r in bait)
    # The last send of each over-length prompt was refused; none was left under the context.
    last: dict[str, dict[str, Any]] = {}
    for r in bait:
        last[r["prompt_id"]] = r
    assert all(r["status"] == 400 for r in last.values()), list(last.values())
    assert cases(report)["stale_bait: over-length"]["state"] == "ran"


def test_small_budget_names_the_probes_that_could_not_run() -> None:
    report = run(WordingServer("vllm-0.32", tokenize=False), requests=30).as_dict()
    assert report["verdict"] == "incomplete" and report["exit_code"] == EXIT_CANNOT_RUN
    states = report["probe_states"]
    assert states["cancellation"]["state"] == "skipped"
    assert "--requests" in states["cancellation"]["reason"]
    assert report["totals"]["requests"] <= 30


def test_skipped_probes_are_excluded_not_incomplete() -> None:
    report = (
        rep := run(WordingServer("sglang"), requests=60, skip_probes=("stale_bait", "cancellation"))
    ).as_dict()
    assert report["verdict"] == "clean", render_summary(rep)
    assert report["probe_states"]["stale_bait"]["state"] == "excluded"
    assert report["totals"]["requests"] <= 60


def test_wording_table_parses_its_own_examples() -> None:
    for w in WORDINGS:
        count = parse_refusal(w.example)
        assert count is not None and count.lower_bound == w.lower_bound, w.example
    vllm_032 = STYLES["vllm-0.32"].format(ctx=4096, n=4097, m=16, t=4113, i=4080)
    c = parse_refusal(vllm_032)
    assert c is not None and (c.tokens, c.lower_bound) == (4097, True)
    assert parse_refusal("rate limited") is None
