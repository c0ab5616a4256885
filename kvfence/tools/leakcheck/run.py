"""One leakcheck run's shared state and plumbing: the budget of requests and time, sending one
request and judging it, tallies per probe and the progress line. The probes live one per file
and drive a `Run`."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import IO

from kvfence.tools.canary import (
    DEFAULT_CHARS_PER_TOKEN,
    CanaryPrompt,
    CanaryRegistry,
    approx_counter,
    build_prompt,
)
from kvfence.tools.leakcheck.api import Api, Reply
from kvfence.tools.leakcheck.common import PROBES, Settings, Tenant
from kvfence.tools.leakcheck.judge import Outcome, judge_status
from kvfence.tools.leakcheck.wording import count_from_error


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
