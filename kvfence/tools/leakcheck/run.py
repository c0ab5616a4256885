"""One leakcheck run's shared state and plumbing: the budget of requests and time, sending one
request and judging it, tallies per probe and the progress line. The probes live one per file
and drive a `Run`."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

from kvfence.tools.canary import (
    DEFAULT_CHARS_PER_TOKEN,
    CanaryPrompt,
    CanaryRegistry,
    approx_counter,
    build_prompt,
)
from kvfence.tools.leakcheck.api import Api, Reply
from kvfence.tools.leakcheck.cases import Cases, Kind
from kvfence.tools.leakcheck.common import PROBES, Settings, Tenant
from kvfence.tools.leakcheck.judge import Outcome, judge_status, read_unjudged, status_unjudged
from kvfence.tools.leakcheck.tally import ProbeTally, Progress
from kvfence.tools.leakcheck.timing_result import TimingResult
from kvfence.tools.leakcheck.wording import parse_refusal


@dataclass
class Target:
    model: str
    context_length: int
    context_source: str  # "server" | "flag"
    tenants: list[Tenant]
    completions: bool = True
    chat: bool = False
    tokenizer: str = "usage"  # "server" (/tokenize) | "usage" (usage.prompt_tokens, errors)
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN  # errs low: "legal" prompts stay legal
    # Errs high, for prompts meant to be over the context (then checked, never trusted).
    chars_per_token_high: float = 4.0
    ratios: list[float] = field(default_factory=list)
    pad_rate: float = 1.0  # tokens per canary.PAD_UNIT, learned while fitting

    def learn_ratio(self, ratio: float) -> None:
        """A served prompt's chars per token, from the server's own count."""
        self.ratios.append(ratio)
        self.chars_per_token_high = max(self.ratios) * 1.05


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
        if "timing" in (settings.probes or ()) or settings.probes is None:
            self.tallies["timing"] = ProbeTally()  # dropped again if it does not run
        self.cases = Cases()
        self.timing: TimingResult | None = None  # the timing probe's result, when it ran
        self.notes: list[str] = []
        self.limit = settings.requests
        self.deadline = time.monotonic() + settings.duration
        self.sem = asyncio.Semaphore(max(1, settings.concurrency))
        self.progress = Progress(settings.requests, err, settings.progress)
        self.target: Target | None = None
        self._reserved = 0
        self.cap: int | None = None  # the current probe's share ends at this many requests
        self._ids = 0
        self._sends: dict[str, int] = {}  # prompt id -> times sent
        self.stopped_early: str | None = None

    # -- plumbing

    def take(self) -> bool:
        """Reserve one request of the budget (False once it, the share or the time is spent)."""
        return self._take()

    def _take(self) -> bool:
        if time.monotonic() > self.deadline:
            self.stopped_early = self.stopped_early or "duration"
            return False
        if self._reserved >= self.limit:
            return False
        if self.cap is not None and self._reserved >= self.cap:
            return False
        self._reserved += 1
        return True

    @property
    def left(self) -> int:
        """Requests the current probe may still send (its share, within the whole budget)."""
        left = self.limit - self._reserved
        if self.cap is not None:
            left = min(left, self.cap - self._reserved)
        return max(0, left)

    def rounds(self, n: int) -> Iterator[tuple[Tenant, Tenant, int]]:
        """A probe's rounds while its `n` requests and the run's time last: this round's tenant,
        the next one in turn (the round's other side), and how many of the `n` are unspent."""
        assert self.target is not None
        tenants = self.target.tenants
        stop = self.left - n
        r = 0
        while self.left > stop and time.monotonic() < self.deadline:
            yield tenants[r % len(tenants)], tenants[(r + 1) % len(tenants)], self.left - stop
            r += 1

    def follow_up_size(self) -> int:
        """Tokens of the short prompts that follow a round's long, cut or bait requests: a sixth
        of the context, within 24..160."""
        assert self.target is not None
        return max(24, min(160, self.target.context_length // 6))

    @property
    def sent(self) -> int:
        return self._reserved

    def new_id(self, probe: str) -> str:
        self._ids += 1
        return f"lc-{self._ids:05d}-{probe}"

    def prompt(
        self, tenant: Tenant, probe: str, tokens: int, *, records: bool = True, over: bool = False
    ) -> CanaryPrompt:
        """A canary prompt of about `tokens`; `over`: sized so that it errs long, not short."""
        t = self.target
        assert t is not None
        count = approx_counter(t.chars_per_token_high if over else t.chars_per_token)
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
        known_source: str = "fit",
        known_is_chat: bool = False,
        kind: Kind = Kind.READ,
    ) -> Outcome | None:
        """One request, judged and recorded; None once the budget, the probe's share or the
        time is spent (the case then shows as skipped unless another send of it ran)."""
        t = self.target
        assert t is not None
        self.cases.plan(probe, case, kind)
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
        # A count made for the completions prompt does not hold once a chat template wraps it.
        known = known_tokens if known_is_chat or not chat else None
        tokens, source, lower = self._count(reply, known, known_source)
        clear = True
        if tokens is None:
            # Only an estimate: judge it only when far from the boundary.
            tokens, source = prompt.tokens, "estimate"
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
            tokens_source=source,
        )
        seen = reply.text + "\n" + (reply.error or "")
        out.leaks = self.registry.find_leaks(seen, prompt.request_id, tenant.name)
        out.echoed_own = self.registry.echoed_own(reply.text, prompt.request_id)
        ctx = t.context_length
        out.wrong_status = judge_status(
            reply, tokens, max_tokens, ctx, clear=clear, lower_bound=lower
        )
        if kind is Kind.STATUS:
            out.unjudged = status_unjudged(reply, tokens, max_tokens, ctx, clear, lower)
        elif kind is Kind.READ:
            out.unjudged = read_unjudged(out, ctx, clear, lower)
        elif reply.status is None or reply.status >= 500:
            out.unjudged = f"no usable answer: {reply.error or reply.status}"
        if reply.status == 200 and reply.prompt_tokens and not chat:
            t.learn_ratio(len(prompt.text) / reply.prompt_tokens)
        self._record(out)
        self.cases.record(probe, case, kind, out.unjudged is None, out.unjudged)
        return out

    @staticmethod
    def _count(reply: Reply, known: int | None, known_source: str) -> tuple[int | None, str, bool]:
        """(the prompt's token count, where it came from, whether it is only a lower bound)."""
        if reply.prompt_tokens is not None:
            return reply.prompt_tokens, "usage", False
        if reply.error:
            count = parse_refusal(reply.error)
            if count is not None:
                return (
                    count.tokens,
                    "refusal (at least)" if count.lower_bound else "refusal",
                    (count.lower_bound),
                )
        if known is not None:
            return known, known_source, known_source.endswith("(at least)")
        return None, "estimate", False

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
        self.progress.update(total.requests, total.leaks, total.wrong_statuses, total.errors)

    def totals(self) -> ProbeTally:
        return sum(self.tallies.values(), ProbeTally())

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
