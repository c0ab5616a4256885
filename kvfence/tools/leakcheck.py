"""`kvfence leakcheck`: checks any OpenAI-compatible deployment from outside for KV leaks between
requests and tenants (canary cross-talk, admission edges, stale-page bait, cancellation) by
reading every answer, not only its status code; exit 0 clean, 1 leak or wrong status, 2 cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx

from kvfence.tools.canary import (
    DEFAULT_CHARS_PER_TOKEN,
    CanaryPrompt,
    CanaryRegistry,
    Leak,
    approx_counter,
    build_prompt,
)

EXIT_CLEAN = 0
EXIT_FAILED = 1  # a leak or a wrong status
EXIT_CANNOT_RUN = 2
REPORT_VERSION = 1
CONTEXT_FIELDS = ("max_model_len", "context_length", "max_context_length")
PROBES = ("setup", "admission", "crosstalk", "stale_bait", "cancellation")
# Statuses that say nothing about the request's length: auth, rate limits, overload.
NOT_A_VERDICT = {401, 403, 408, 429}
# How the common servers phrase a prompt's token count in a context-length error.
_COUNT_PATTERNS = (
    re.compile(r"(\d+) in the (?:messages|prompt|input)"),
    re.compile(r"prompt (?:has|contains|is|of) (\d+) tokens"),
    re.compile(r"request has (\d+) input tokens"),
    re.compile(r"input (?:length|tokens?)\D{0,12}(\d+)", re.I),
)
_MAX_FIT_STEPS = 5
_EXCERPT = 60


class CannotRun(Exception):
    """The check could not be run at all (exit 2): nothing about leaks is known."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str


@dataclass(frozen=True)
class Settings:
    base_url: str
    tenants: tuple[Tenant, ...]
    model: str | None = None
    context_length: int | None = None
    requests: int = 200
    concurrency: int = 8
    duration: float = 300.0
    timeout: float = 180.0
    seed: int | None = None
    report: str | None = None
    progress: bool = True


# ---- discovery -----------------------------------------------------------------------------


def api_root(base_url: str) -> str:
    """`http://h:8000`, `http://h:8000/` and `http://h:8000/v1` all mean the same server."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CannotRun(f"--base-url must be an http(s) URL, got {base_url!r}")
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{parts.scheme}://{parts.netloc}{path}"


def context_length_of(card: dict[str, Any]) -> int | None:
    for name in CONTEXT_FIELDS:
        value = card.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def pick_model(payload: Any, wanted: str | None) -> tuple[str | None, int | None]:
    """(model id, context length it reports) from a /v1/models body: the wanted one, else the
    first; either may be None."""
    cards = payload.get("data") if isinstance(payload, dict) else None
    cards = [c for c in cards or [] if isinstance(c, dict) and isinstance(c.get("id"), str)]
    if wanted is not None:
        for c in cards:
            if c["id"] == wanted:
                return wanted, context_length_of(c)
        return wanted, None
    if not cards:
        return None, None
    return cards[0]["id"], context_length_of(cards[0])


def count_from_error(message: str) -> int | None:
    for pattern in _COUNT_PATTERNS:
        m = pattern.search(message)
        if m:
            return int(m.group(1))
    return None


# ---- one request ---------------------------------------------------------------------------


@dataclass
class Reply:
    status: int | None  # None: no response (transport error, or cancelled before headers)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    error_code: str | None = None
    server_id: str | None = None
    cancelled: bool = False


class Api:
    """The only thing that talks to the server: one base URL, no redirects, no proxies."""

    def __init__(
        self, root: str, timeout: float, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.root = root
        self.model = ""
        # trust_env=False: an HTTP(S)_PROXY in the environment would be another address.
        self.client = httpx.AsyncClient(
            base_url=root,
            follow_redirects=False,
            trust_env=False,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=64),
        )

    async def close(self) -> None:
        await self.client.aclose()

    @staticmethod
    def _headers(tenant: Tenant, request_id: str | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {tenant.key}"}
        if request_id:
            h["X-Request-Id"] = request_id  # lets the operator find it in the server's logs
        return h

    async def models(self, tenant: Tenant) -> httpx.Response:
        return await self.client.get("/v1/models", headers=self._headers(tenant))

    async def tokenize(self, tenant: Tenant, text: str) -> int | None:
        """vLLM's (and SGLang's) tokenizer endpoint, when the server has one."""
        for path in ("/tokenize", "/v1/tokenize"):
            try:
                r = await self.client.post(
                    path, json={"model": self.model, "prompt": text}, headers=self._headers(tenant)
                )
            except httpx.HTTPError:
                return None
            if r.status_code != 200:
                continue
            try:
                body = r.json()
            except ValueError:
                continue
            if isinstance(body.get("count"), int):
                return int(body["count"])
            if isinstance(body.get("tokens"), list):
                return len(body["tokens"])
        return None

    async def generate(
        self,
        tenant: Tenant,
        request_id: str,
        text: str,
        max_tokens: int | None,
        *,
        chat: bool = False,
        stream: bool = False,
        cut_after: int | None = None,
    ) -> Reply:
        body: dict[str, Any] = {"model": self.model, "temperature": 0}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = self._headers(tenant, request_id)
        try:
            if not stream:
                r = await self.client.post(path, json=body, headers=headers)
                return _parse_reply(r, chat)
            return await self._stream(path, body, headers, chat, cut_after)
        except httpx.HTTPError as e:
            return Reply(None, error=f"{type(e).__name__}: {e}"[:300])

    async def _stream(
        self,
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
        chat: bool,
        cut_after: int | None,
    ) -> Reply:
        async with self.client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return _parse_reply(r, chat)
            reply = Reply(200)
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                _apply_event(reply, event, chat)
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    # Leaving the block closes the connection mid-answer: a client hang-up.
                    reply.cancelled = True
                    break
            return reply


def _apply_event(reply: Reply, event: dict[str, Any], chat: bool) -> None:
    reply.server_id = reply.server_id or event.get("id")
    if "error" in event:  # an error inside a 200 stream
        reply.error = str(event["error"])[:300]
    for choice in event.get("choices") or []:
        if chat:
            reply.text += (choice.get("delta") or {}).get("content") or ""
        else:
            reply.text += choice.get("text") or ""
    usage = event.get("usage") or {}
    reply.prompt_tokens = usage.get("prompt_tokens", reply.prompt_tokens)
    reply.completion_tokens = usage.get("completion_tokens", reply.completion_tokens)


def _parse_reply(r: httpx.Response, chat: bool) -> Reply:
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return Reply(r.status_code, error=f"non-JSON body: {r.text[:200]!r}")
    if r.status_code >= 300:
        err = body.get("error")
        if isinstance(err, dict):
            message, code = str(err.get("message", "")), err.get("code")
        else:
            message, code = str(err or body.get("detail") or body)[:500], None
        where = ""
        if r.is_redirect:
            where = f" (redirect to {r.headers.get('location')!r} not followed)"
        return Reply(r.status_code, error=message + where, error_code=str(code) if code else None)
    reply = Reply(r.status_code, server_id=body.get("id"))
    for choice in body.get("choices") or []:
        if chat:
            reply.text += (choice.get("message") or {}).get("content") or ""
        else:
            reply.text += choice.get("text") or ""
    usage = body.get("usage") or {}
    reply.prompt_tokens = usage.get("prompt_tokens")
    reply.completion_tokens = usage.get("completion_tokens")
    return reply


# ---- judging -------------------------------------------------------------------------------


@dataclass
class Outcome:
    request_id: str  # ours, also sent as X-Request-Id
    prompt_id: str  # owner of the prompt's canaries (several sends may share one prompt)
    probe: str
    case: str
    tenant: str
    endpoint: str
    stream: bool
    max_tokens: int | None
    prompt_tokens: int | None  # best known: server usage > error message > tokenizer > fit
    reply: Reply
    leaks: list[Leak] = field(default_factory=list)
    wrong_status: str | None = None
    echoed_own: bool = False

    @property
    def error(self) -> str | None:
        r = self.reply
        if r.cancelled and r.status is None:
            return None  # we hung up on purpose
        if r.status is None or r.status >= 500 or r.status in NOT_A_VERDICT:
            return r.error or f"HTTP {r.status}"
        if 300 <= r.status < 400:
            return r.error
        return None

    def as_dict(self) -> dict[str, Any]:
        r = self.reply
        return {
            "request_id": self.request_id,
            "prompt_id": self.prompt_id,
            "probe": self.probe,
            "case": self.case,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "status": r.status,
            "cancelled": r.cancelled,
            "server_id": r.server_id,
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "completion_tokens": r.completion_tokens,
            "echoed_own": self.echoed_own,
            "leaks": len(self.leaks),
            "wrong_status": self.wrong_status,
            "error": self.error,
        }


def judge_status(
    reply: Reply, prompt_tokens: int | None, max_tokens: int | None, context: int, *, clear: bool
) -> str | None:
    """Why this status is wrong for a request of this length, or None.

    Legal means prompt + max_tokens <= context (at least one new token when max_tokens is left
    to the server). Over-length must be refused with a 4xx; a 2xx is tolerated only when the
    server provably computed nothing past the context (a prompt of exactly N answered with an
    empty completion, or max_tokens clamped so prompt + completion <= N). A legal request
    refused with a 4xx means the advertised context cannot be served (the incident's first
    fault). `clear` says a length that is only estimated is far enough from N to judge."""
    if reply.status is None or reply.status in NOT_A_VERDICT or reply.status >= 500:
        return None
    if prompt_tokens is None or not clear:
        return None
    legal = prompt_tokens + (max_tokens if max_tokens is not None else 1) <= context
    ok = 200 <= reply.status < 300
    if legal and 400 <= reply.status < 500:
        return (
            f"HTTP {reply.status} for a request within the advertised context "
            f"({prompt_tokens} + {max_tokens} <= {context}): {reply.error or ''}"[:300]
        )
    if not legal and ok:
        done = reply.completion_tokens
        if reply.cancelled and not reply.text:
            return None  # hung up before any token: nothing to hold against it
        if done is not None and prompt_tokens <= context and prompt_tokens + done <= context:
            return None
        return (
            f"HTTP {reply.status} for an over-length request ({prompt_tokens} prompt tokens, "
            f"max_tokens {max_tokens}, context {context}): it must be refused with a 4xx"
        )
    return None


# ---- progress and tallies ------------------------------------------------------------------


@dataclass
class ProbeTally:
    requests: int = 0
    served: int = 0  # 2xx
    refused: int = 0  # 4xx
    leaks: int = 0  # requests whose output held another request's canary
    wrong_statuses: int = 0
    errors: int = 0
    echoed_own: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class Progress:
    """A one-line bar on a terminal; a line per 10% elsewhere (CI logs)."""

    def __init__(self, total: int, stream: IO[str], enabled: bool) -> None:
        self.total = max(total, 1)
        self.stream = stream
        self.enabled = enabled
        self.tty = enabled and stream.isatty()
        self.start = time.monotonic()
        self._last_decile = -1

    def update(self, done: int, leaks: int, wrong: int, errors: int) -> None:
        if not self.enabled:
            return
        frac = min(done / self.total, 1.0)
        line = (
            f"leakcheck {done}/{self.total} requests, leaks {leaks}, wrong status {wrong}, "
            f"errors {errors}, {time.monotonic() - self.start:.0f} s"
        )
        if self.tty:
            bar = "#" * int(frac * 30)
            self.stream.write(f"\r[{bar:<30}] {line}")
            self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- the run -------------------------------------------------------------------------------


@dataclass
class Target:
    model: str
    context_length: int
    context_source: str  # "server" | "flag"
    tenants: list[Tenant]
    completions: bool = True
    chat: bool = False
    tokenizer: str = "usage"  # "server" (/tokenize) | "usage" (usage.prompt_tokens, errors)
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN


class Run:
    def __init__(self, settings: Settings, api: Api, err: IO[str]) -> None:
        self.s = settings
        self.api = api
        self.rng = random.Random(settings.seed)
        # With a seed the canaries repeat too, so a failing run can be replayed exactly.
        self.registry = CanaryRegistry(
            random.Random(settings.seed + 1) if settings.seed is not None else None
        )
        self.outcomes: list[Outcome] = []
        self.tallies = {p: ProbeTally() for p in PROBES}
        self.notes: list[str] = []
        self.limit = settings.requests
        self.deadline = time.monotonic() + settings.duration
        self.sem = asyncio.Semaphore(max(1, settings.concurrency))
        self.progress = Progress(settings.requests, err, settings.progress)
        self.target: Target | None = None
        self._reserved = 0
        self._ids = 0
        self._sends: dict[str, int] = {}  # prompt id -> times sent
        self.stopped_early: str | None = None

    # -- plumbing

    def _take(self) -> bool:
        if time.monotonic() > self.deadline:
            self.stopped_early = self.stopped_early or "duration"
            return False
        if self._reserved >= self.limit:
            return False
        self._reserved += 1
        return True

    @property
    def left(self) -> int:
        return max(0, self.limit - self._reserved)

    def new_id(self, probe: str) -> str:
        self._ids += 1
        return f"lc-{self._ids:05d}-{probe}"

    def prompt(
        self, tenant: Tenant, probe: str, tokens: int, *, records: bool = True
    ) -> CanaryPrompt:
        t = self.target
        assert t is not None
        count = approx_counter(t.chars_per_token)
        return build_prompt(
            self.registry,
            tenant.name,
            self.new_id(probe),
            max(tokens, 8),
            rng=self.rng,
            count_tokens=count,
            records=records,
        )

    async def send(
        self,
        probe: str,
        case: str,
        tenant: Tenant,
        prompt: CanaryPrompt,
        max_tokens: int | None,
        *,
        chat: bool = False,
        stream: bool = False,
        cut_after: int | None = None,
        cancel_after_s: float | None = None,
        known_tokens: int | None = None,
    ) -> Outcome | None:
        """One request, judged and recorded; None once the budget or the time is spent."""
        t = self.target
        assert t is not None
        if not self._take():
            return None
        chat = chat or not t.completions
        sends = self._sends[prompt.request_id] = self._sends.get(prompt.request_id, 0) + 1
        rid = f"{prompt.request_id}.{sends}"
        async with self.sem:
            call = self.api.generate(
                tenant, rid, prompt.text, max_tokens, chat=chat, stream=stream, cut_after=cut_after
            )
            if cancel_after_s is None:
                reply = await call
            else:
                try:
                    reply = await asyncio.wait_for(call, cancel_after_s)
                except TimeoutError:
                    reply = Reply(None, cancelled=True)
        # A completions prompt's own count is the fit's; a chat prompt adds a template.
        tokens = reply.prompt_tokens
        if tokens is None and reply.error:
            tokens = count_from_error(reply.error)
        if tokens is None and not chat:
            tokens = known_tokens
        clear = True
        if tokens is None:
            # Only an estimate: judge it only when far from the boundary.
            tokens = prompt.tokens
            need = tokens + (max_tokens if max_tokens is not None else 1)
            clear = need > 1.5 * t.context_length or need < 0.6 * t.context_length
        out = Outcome(
            request_id=rid,
            prompt_id=prompt.request_id,
            probe=probe,
            case=case,
            tenant=tenant.name,
            endpoint="chat" if chat else "completions",
            stream=stream,
            max_tokens=max_tokens,
            prompt_tokens=tokens,
            reply=reply,
        )
        seen = reply.text + "\n" + (reply.error or "")
        out.leaks = self.registry.find_leaks(seen, prompt.request_id, tenant.name)
        out.echoed_own = self.registry.echoed_own(reply.text, prompt.request_id)
        out.wrong_status = judge_status(reply, tokens, max_tokens, t.context_length, clear=clear)
        self._record(out)
        return out

    def _record(self, out: Outcome) -> None:
        self.outcomes.append(out)
        tally = self.tallies[out.probe]
        tally.requests += 1
        status = out.reply.status or 0
        tally.served += 200 <= status < 300
        tally.refused += 400 <= status < 500
        tally.leaks += bool(out.leaks)
        tally.wrong_statuses += out.wrong_status is not None
        tally.errors += out.error is not None
        tally.echoed_own += out.echoed_own
        total = self.totals()
        self.progress.update(
            total["requests"], total["leaks"], total["wrong_statuses"], total["errors"]
        )

    def totals(self) -> dict[str, int]:
        keys = ("requests", "served", "refused", "leaks", "wrong_statuses", "errors", "echoed_own")
        return {k: sum(getattr(t, k) for t in self.tallies.values()) for k in keys}

    async def pool(self, n: int, job: Callable[[int], Awaitable[object]]) -> None:
        """Run job(0..n-1) with at most `concurrency` in flight, stopping once the budget is
        spent (a job that finds none left simply returns)."""
        it = iter(range(n))

        async def worker() -> None:
            for i in it:
                if self.left == 0 or time.monotonic() > self.deadline:
                    return
                await job(i)

        await asyncio.gather(*(worker() for _ in range(min(n, self.s.concurrency))))

    # -- setup

    async def setup(self) -> Target:
        s = self.s
        models_body: Any = None
        live: list[Tenant] = []
        unreachable: str | None = None
        for tenant in s.tenants:
            try:
                r = await self.api.models(tenant)
            except httpx.HTTPError as e:
                unreachable = f"{type(e).__name__}: {e}"
                break
            if r.status_code in (401, 403):
                self.notes.append(f"key of tenant {tenant.name} refused by /v1/models")
                continue
            live.append(tenant)
            if r.status_code == 200 and models_body is None:
                try:
                    models_body = r.json()
                except ValueError:
                    models_body = None
        if unreachable:
            raise CannotRun(f"{self.api.root} is unreachable: {unreachable}")
        if not live:
            raise CannotRun("every API key was refused (401/403): check --api-key")
        model, ctx = pick_model(models_body, s.model)
        if model is None:
            raise CannotRun("the server lists no model at /v1/models: pass --model")
        source = "server"
        if s.context_length is not None:
            if ctx is not None and ctx != s.context_length:
                self.notes.append(
                    f"server reports context length {ctx}; checking the given {s.context_length}"
                )
            ctx, source = s.context_length, "flag"
        if ctx is None:
            raise CannotRun(
                "the server does not report a context length at /v1/models "
                f"({', '.join(CONTEXT_FIELDS)}): pass --context-length"
            )
        self.api.model = model
        self.target = t = Target(model, ctx, source, live)
        await self._first_requests(t)
        return t

    async def _first_requests(self, t: Target) -> None:
        """One short request per key (drops refused keys, calibrates chars/token), then a
        chat request and the tokenizer endpoint to learn what the server offers."""
        ratios: list[float] = []
        tenants = list(t.tenants)
        t.tenants = []
        completions_missing = 0
        for tenant in tenants:
            p = self.prompt(tenant, "setup", min(96, t.context_length // 4))
            out = await self.send("setup", "first request", tenant, p, 16)
            if out is None:
                break
            status = out.reply.status
            if status in (401, 403):
                self.notes.append(f"key of tenant {tenant.name} refused: {out.reply.error}")
                continue
            if status in (404, 405):
                completions_missing += 1
            t.tenants.append(tenant)
            if out.reply.prompt_tokens and status == 200:
                ratios.append(len(p.text) / out.reply.prompt_tokens)
        if not t.tenants:
            raise CannotRun("every API key was refused (401/403): check --api-key")
        if completions_missing == len(t.tenants):
            t.completions = False
            self.notes.append("no /v1/completions here: every probe uses chat")
        if ratios:
            # Err low: a prompt meant to be legal must not come out over the context.
            t.chars_per_token = min(ratios) * 0.95
        p = self.prompt(t.tenants[0], "setup", min(96, t.context_length // 4))
        out = await self.send("setup", "chat support", t.tenants[0], p, 16, chat=True)
        t.chat = out is not None and out.reply.status == 200
        if not t.chat:
            self.notes.append("chat completions unavailable: probes use completions only")
        if t.completions and await self.api.tokenize(t.tenants[0], "hello") is not None:
            t.tokenizer = "server"
        if len(t.tenants) == 1:
            self.notes.append(
                "one tenant: leaks are checked between requests (same_tenant_other_request)"
            )

    # -- probe 2: admission edges

    async def measure(self, tenant: Tenant, p: CanaryPrompt, label: str) -> int | None:
        t = self.target
        assert t is not None
        if t.tokenizer == "server":
            return await self.api.tokenize(tenant, p.text)
        # No tokenizer: a 1-token request tells (usage, or the count in its error), and is
        # itself an admission check of whatever length it turns out to have.
        out = await self.send("admission", f"measure {label}", tenant, p, 1)
        if out is None:
            return None
        r = out.reply
        if r.status == 200 and r.prompt_tokens is not None:
            return r.prompt_tokens
        if r.error:
            return count_from_error(r.error)
        return None

    async def fit(self, tenant: Tenant, target: int, label: str) -> tuple[CanaryPrompt, int | None]:
        """A prompt of exactly `target` server tokens when the server's counts allow it; the
        best one found (and its count, if known) otherwise."""
        p = self.prompt(tenant, "admission", target)
        n = None
        for _ in range(_MAX_FIT_STEPS):
            n = await self.measure(tenant, p, label)
            if n is None or n == target:
                return p, n
            pad = p.pad + (target - n)
            if pad < 0:  # too long even unpadded: rebuild shorter by the observed ratio
                p = self.prompt(tenant, "admission", int(p.tokens * target / n) - 2)
            else:
                p = p.padded(pad)
        return p, n

    async def admission(self) -> None:
        t = self.target
        assert t is not None
        n = t.context_length
        a = t.tenants[0]
        b = t.tenants[-1]
        p, c = await self.fit(a, n - 1, "N-1")
        if c is not None and c < n and t.tokenizer == "server":
            await self.send("admission", "N-1, max_tokens to N", a, p, n - c, known_tokens=c)
        p, c = await self.fit(b, n, "N")
        if c is not None:
            await self.send("admission", "N, default max_tokens", b, p, None, known_tokens=c)
        p, c = await self.fit(a, n + 1, "N+1")
        if c is not None:
            await self.send("admission", "N+1", a, p, 16, known_tokens=c)
            if t.chat:
                await self.send("admission", "N+1 chat", a, p, 16, chat=True)
            await self.send("admission", "N+1 stream", a, p, 16, stream=True, known_tokens=c)
        p = self.prompt(b, "admission", 2 * n)
        await self.send("admission", "2N", b, p, 16)
        p, c = await self.fit(a, max(8, n - 48), "N-48")
        if c is not None and c < n:
            await self.send(
                "admission", "prompt + max_tokens = N+1", a, p, n - c + 1, known_tokens=c
            )

    # -- probe 1: canary cross-talk

    async def crosstalk(self, n: int) -> None:
        t = self.target
        assert t is not None
        hi = max(48, min(400, t.context_length // 2))

        async def one(i: int) -> None:
            tenant = t.tenants[i % len(t.tenants)]
            p = self.prompt(tenant, "crosstalk", self.rng.randint(min(48, hi), hi))
            chat = t.chat and i % 3 == 2
            await self.send(
                "crosstalk", "canary recall", tenant, p, 24, chat=chat, stream=i % 5 == 4
            )

        await self.pool(n, one)

    # -- probe 3: stale-page bait

    async def stale_bait(self, n: int) -> None:
        """Fill the cache with one tenant's canaries, then ask another for what only stale
        pages could answer: over-length prompts, long prompts a short prefill pool cannot
        hold (the incident), aborted ones, and bare cues that own no canary at all."""
        t = self.target
        assert t is not None
        ctx = t.context_length
        stop = self.left - n
        r = 0
        while self.left > stop and time.monotonic() < self.deadline:
            a = t.tenants[r % len(t.tenants)]
            b = t.tenants[(r + 1) % len(t.tenants)]
            r += 1

            def fill(_: int, a: Tenant = a) -> Awaitable[object]:
                # Log-uniform lengths: an unknown pool keeps only the prompts that fit it.
                size = int(math.exp(self.rng.uniform(math.log(ctx * 0.1), math.log(ctx * 0.9))))
                return self.send("stale_bait", "fill", a, self.prompt(a, "stale_bait", size), 16)

            await asyncio.gather(*(fill(i) for i in range(min(6, self.left - stop))))

            def long_legal(b: Tenant = b) -> Awaitable[object]:
                size = self.rng.randint(int(ctx * 0.45), max(int(ctx * 0.45), ctx - 40))
                p = self.prompt(b, "stale_bait", size)
                return self.send("stale_bait", "long within context", b, p, 32)

            over = self.prompt(b, "stale_bait", self.rng.choice([ctx + 16, int(ctx * 1.5)]))
            aborted = self.prompt(b, "stale_bait", self.rng.randint(int(ctx * 0.3), ctx - 40))
            await asyncio.gather(
                long_legal(),
                long_legal(),
                long_legal(),
                self.send("stale_bait", "over-length", b, over, 32),
                self.send(
                    "stale_bait",
                    "aborted long",
                    b,
                    aborted,
                    32,
                    stream=True,
                    cut_after=self.rng.choice([1, 2]),
                ),
            )
            size = max(24, min(160, ctx // 6))
            bare = [self.prompt(b, "stale_bait", size, records=False) for _ in range(2)]
            own = self.prompt(a, "stale_bait", size)
            await asyncio.gather(
                *(self.send("stale_bait", "bare cue after bait", b, p, 32) for p in bare),
                self.send("stale_bait", "short after bait", a, own, 32),
            )

    # -- probe 4: cancellation

    async def cancellation(self, n: int) -> None:
        t = self.target
        assert t is not None
        ctx = t.context_length
        stop = self.left - n
        r = 0
        while self.left > stop and time.monotonic() < self.deadline:
            x = t.tenants[r % len(t.tenants)]
            y = t.tenants[(r + 1) % len(t.tenants)]
            r += 1
            p = self.prompt(x, "cancellation", self.rng.randint(int(ctx * 0.2), int(ctx * 0.8)))
            cut = self.rng.choice([0, 1, 2, 5])
            if cut == 0:  # hang up before the answer starts (possibly mid-transfer)
                await self.send(
                    "cancellation",
                    "cut before first token",
                    x,
                    p,
                    64,
                    stream=True,
                    cancel_after_s=self.rng.uniform(0.01, 0.2),
                )
            else:
                await self.send(
                    "cancellation",
                    f"cut after {cut} chunks",
                    x,
                    p,
                    64,
                    stream=True,
                    cut_after=cut,
                )
            size = max(24, min(160, ctx // 6))
            await asyncio.gather(
                self.send(
                    "cancellation",
                    "bare cue after cut",
                    y,
                    self.prompt(y, "cancellation", size, records=False),
                    32,
                ),
                self.send(
                    "cancellation", "recall after cut", y, self.prompt(y, "cancellation", size), 32
                ),
            )

    async def run(self) -> None:
        await self.setup()
        quota_admission = min(24, max(8, self.limit // 8))
        quota_stale = max(8, self.limit // 5)
        quota_cancel = max(6, self.limit // 8)
        before = self.left
        await self.admission()
        spent = before - self.left
        if spent > quota_admission:
            self.notes.append(f"admission probe used {spent} requests")
        await self.crosstalk(max(0, self.left - quota_stale - quota_cancel))
        await self.stale_bait(max(0, self.left - quota_cancel))
        await self.cancellation(self.left)
        if self.stopped_early:
            self.notes.append(f"stopped early: --{self.stopped_early} reached")


# ---- report --------------------------------------------------------------------------------


def verdict_of(totals: dict[str, int]) -> tuple[str, int]:
    if totals["leaks"]:
        return "leak", EXIT_FAILED
    if totals["wrong_statuses"]:
        return "wrong_status", EXIT_FAILED
    if not totals["served"]:
        return "could_not_run", EXIT_CANNOT_RUN  # no answer was read: nothing is proven
    return "clean", EXIT_CLEAN


def _excerpt(text: str, fragment: str) -> str:
    i = text.upper().find(fragment)
    if i < 0:
        return text[: 2 * _EXCERPT]
    return text[max(0, i - _EXCERPT) : i + len(fragment) + _EXCERPT]


def build_report(
    settings: Settings, run: Run | None, started: float, cannot_run: str | None
) -> dict[str, Any]:
    t = run.target if run else None
    totals = run.totals() if run else {}
    if cannot_run is not None:
        verdict, code = "could_not_run", EXIT_CANNOT_RUN
    else:
        verdict, code = verdict_of(totals)
    findings: list[dict[str, Any]] = []
    outcomes = run.outcomes if run else []
    for o in outcomes:
        for leak in o.leaks:
            findings.append(
                {
                    "kind": "leak",
                    "probe": o.probe,
                    "case": o.case,
                    "request_id": o.request_id,
                    "server_id": o.reply.server_id,
                    "status": o.reply.status,
                    "prompt_tokens": o.prompt_tokens,
                    **{k: v for k, v in leak.as_dict().items() if k != "kind"},
                    "leak_kind": leak.kind,
                    "cross_tenant": leak.cross_tenant,
                    "output_excerpt": _excerpt(o.reply.text + (o.reply.error or ""), leak.fragment),
                }
            )
        if o.wrong_status:
            findings.append(
                {
                    "kind": "wrong_status",
                    "probe": o.probe,
                    "case": o.case,
                    "request_id": o.request_id,
                    "server_id": o.reply.server_id,
                    "status": o.reply.status,
                    "prompt_tokens": o.prompt_tokens,
                    "max_tokens": o.max_tokens,
                    "detail": o.wrong_status,
                }
            )
    errors = [o.as_dict() for o in outcomes if o.error][:20]
    return {
        "kvfence_leakcheck": REPORT_VERSION,
        "verdict": verdict,
        "exit_code": code,
        "reason": cannot_run,
        "target": {
            "base_url": settings.base_url,
            "model": t.model if t else settings.model,
            "context_length": t.context_length if t else settings.context_length,
            "context_length_source": t.context_source if t else None,
            "tenants": [x.name for x in t.tenants] if t else [x.name for x in settings.tenants],
            "endpoints": (["completions"] if t.completions else []) + (["chat"] if t.chat else [])
            if t
            else [],
            "token_counts": t.tokenizer if t else None,
        },
        "settings": {
            "requests": settings.requests,
            "concurrency": settings.concurrency,
            "duration_s": settings.duration,
            "seed": settings.seed,
        },
        "duration_s": round(time.monotonic() - started, 3),
        "totals": totals,
        "probes": {p: tally.as_dict() for p, tally in (run.tallies.items() if run else [])},
        "findings": findings,
        "errors": errors,
        "notes": run.notes if run else [],
        "requests": [o.as_dict() for o in outcomes],
    }


def render_summary(report: dict[str, Any]) -> str:
    t = report["target"]
    lines = [
        f"kvfence leakcheck: {t['base_url']}  model {t['model']}  context {t['context_length']} "
        f"({t['context_length_source']})  tenants {len(t['tenants'])}",
        "",
        f"{'probe':<14}{'requests':>9}{'leaks':>7}{'wrong status':>14}{'errors':>8}"
        f"{'echoed own':>12}",
    ]
    rows = [*report["probes"].items(), ("total", report["totals"])]
    for name, tally in rows:
        if not tally:
            continue
        lines.append(
            f"{name:<14}{tally['requests']:>9}{tally['leaks']:>7}{tally['wrong_statuses']:>14}"
            f"{tally['errors']:>8}{tally['echoed_own']:>12}"
        )
    shown = report["findings"][:10]
    if shown:
        lines += ["", "findings:"]
    for f in shown:
        if f["kind"] == "leak":
            lines.append(
                f"  LEAK [{f['probe']}: {f['case']}] request {f['request_id']} "
                f"(tenant {f['reader_tenant']}, HTTP {f['status']}) holds {f['fragment']!r} of "
                f"request {f['owner_request_id']} (tenant {f['owner_tenant']}, {f['leak_kind']})"
            )
        else:
            lines.append(
                f"  WRONG STATUS [{f['probe']}: {f['case']}] request {f['request_id']}: "
                f"{f['detail']}"
            )
    if len(report["findings"]) > len(shown):
        lines.append(f"  ... {len(report['findings']) - len(shown)} more in the report")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    totals = report["totals"]
    if totals.get("served") and totals.get("echoed_own", 0) < 0.5 * totals["served"]:
        lines.append(
            "note: fewer than half the answers repeated their own canaries; this model copies "
            "its context rarely, so a leak could stay unseen"
        )
    verdict = report["verdict"]
    why = f": {report['reason']}" if report["reason"] else ""
    lines += ["", f"verdict: {verdict.upper()} (exit {report['exit_code']}){why}"]
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------


def _tenants(keys: Sequence[str], key_file: str | None) -> list[Tenant]:
    pairs: list[tuple[str, str | None]] = [(k, None) for k in keys]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            parts = line.split()
            if parts and not parts[0].startswith("#"):
                pairs.append((parts[0], parts[1] if len(parts) > 1 else None))
    out: list[Tenant] = []
    for i, (key, name) in enumerate(pairs):
        # Never the key itself: reports and logs get shared.
        out.append(Tenant(name or f"tenant{i + 1}", key))
    return out


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(
        prog="kvfence leakcheck",
        description="Check an OpenAI-compatible deployment for KV-cache leaks between requests "
        "and tenants by reading the answers (exit 0 clean, 1 leak or wrong status, 2 cannot run).",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://vllm-host:8000 (or .../v1)")
    p.add_argument(
        "--api-key", action="append", default=[], help="repeat: each key is a tenant (2+ best)"
    )
    p.add_argument(
        "--api-key-file", default=None, help="lines of `key [tenant]` (keeps keys off ps)"
    )
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument(
        "--context-length", type=int, default=None, help="default: what /v1/models reports"
    )
    p.add_argument("--requests", type=int, default=200, help="total requests sent (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds at most (default 300)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--seed", type=int, default=None, help="replay prompts and canaries exactly")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = p.parse_args(argv)
    tenants = _tenants(a.api_key, a.api_key_file)
    if not tenants:
        p.error("give at least one --api-key (two or more to check between tenants)")
    for name, value in (("--requests", a.requests), ("--concurrency", a.concurrency)):
        if value < 1:
            p.error(f"{name} must be at least 1")
    if a.context_length is not None and a.context_length < 16:
        p.error("--context-length must be at least 16")
    return Settings(
        base_url=a.base_url,
        tenants=tuple(tenants),
        model=a.model,
        context_length=a.context_length,
        requests=a.requests,
        concurrency=a.concurrency,
        duration=a.duration,
        timeout=a.timeout,
        seed=a.seed,
        report=a.report,
        progress=not a.no_progress,
    )


async def check(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    err: IO[str] | None = None,
) -> dict[str, Any]:
    """Run every probe against `settings.base_url`; returns the report (see `build_report`)."""
    started = time.monotonic()
    err = err if err is not None else sys.stderr
    run: Run | None = None
    cannot: str | None = None
    try:
        api = Api(api_root(settings.base_url), settings.timeout, transport)
    except CannotRun as e:
        return build_report(settings, None, started, str(e))
    try:
        run = Run(settings, api, err)
        await run.run()
    except CannotRun as e:
        cannot = str(e)
    finally:
        if run is not None:
            run.progress.close()
        await api.close()
    return build_report(settings, run, started, cannot)


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    report = asyncio.run(check(settings))
    print(render_summary(report))
    if settings.report:
        Path(settings.report).write_text(json.dumps(report, indent=2) + "\n")
        print(f"report: {settings.report}")
    return int(report["exit_code"])


__all__ = [
    "CannotRun",
    "Settings",
    "Tenant",
    "api_root",
    "check",
    "context_length_of",
    "count_from_error",
    "judge_status",
    "main",
    "pick_model",
    "render_summary",
    "verdict_of",
]

if __name__ == "__main__":
    sys.exit(main())
