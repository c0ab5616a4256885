"""The chaos soak's cache mix: the traffic and per-request checks of kvfence.tools.chaos_cache.

Tenants hold multi-turn conversations sent as token ids (so the soak knows every token a tenant
put in a cache): each begins with one of a few heads (the operator's declared public prefix, one
system prompt identical for every tenant but not declared public, both, or none), then private
turns of canary records whose answers (their exact token ids) go back into the history, so
within-tenant prefix hits happen turn after turn. Every answer is checked as chaos.py checks
it (no foreign canary, no short or over-length 200), every error against the one table of
failure classes (server/errors.py), and afterwards every `cached_tokens` against what the
tenant's own history and the public prefix could explain (`Ledger.credit_breaches`).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvfence.server.errors import table_mismatch
from kvfence.sse import iter_events
from kvfence.tools.canary import CanaryRegistry, build_prompt
from kvfence.tools.chaos import Tally

PUBLIC_TEXT = (
    "You answer questions about the records below. Each record is a key, a colon and a code; "
    "reply with the code of the key asked for, exactly as written, and nothing else.\n"
)
# Identical for every tenant and NOT declared public: the case where engines leak (a shared
# system prompt must still be cached once per tenant).
SYSTEM_TEXT = (
    "Records follow. They belong to one customer of the service and are confidential: never "
    "repeat a code that is not in this conversation. Answer with one code per question.\n"
)
# Which head a conversation starts with (weights): the identical system prompt most often.
HEADS = (("public", 2), ("system", 4), ("public+system", 2), ("none", 1))
# A drain (30 s) and a restart on a loaded machine fit well inside: a timeout is a hang.
TIMEOUT_S = 120.0


@dataclass
class Conversation:
    tenant: str
    key: str
    cid: str  # the canaries' owner in the registry: every turn's canaries are its own
    head: str
    ids: list[int]  # the history: head, turns and their answers, as token ids
    turns_left: int
    turn: int = 0


@dataclass
class Sent:
    """One request as the ledger keeps it: for the cached-tokens check and the hit rate."""

    tenant: str
    index: int  # order of sending over the whole soak
    prompt: tuple[int, ...]
    turn: int
    answered_after: int = -1  # sends that had started when its answer came (-1: no answer)
    cached: int | None = None
    output: tuple[int, ...] = ()


class Ledger:
    """What every tenant sent, in order, and what each answer credited as cached."""

    def __init__(self, public_ids: list[int]) -> None:
        self.public = tuple(public_ids)
        self.sent: list[Sent] = []
        self._lock = threading.Lock()

    def send(self, tenant: str, prompt: list[int], turn: int) -> Sent:
        with self._lock:
            s = Sent(tenant, len(self.sent), tuple(prompt), turn)
            self.sent.append(s)
            return s

    def answer(self, s: Sent, cached: int | None, output: list[int]) -> None:
        with self._lock:
            s.answered_after, s.cached, s.output = len(self.sent), cached, tuple(output)

    def credit_breaches(self, page: int) -> list[dict]:
        """Answers that credit more cached pages than the public prefix and the tenant's own
        earlier traffic hold: a page can only come from the cache if some request put its
        tokens there, so a credit past the longest such page prefix came from another tenant.
        A request's own prompt is its source too once it was preempted (the scheduler counts
        the reuse of the admission that produced its output), so a credit past every other
        request's pages is its own; the breach is a credit only another tenant could give."""
        # (tenant or None for all, hash of a page-aligned prefix) -> the first two senders
        firsts: dict[tuple[str | None, int], list[int]] = {}
        for s in self.sent:
            for seq in (s.prompt, s.prompt + s.output):
                for h in _page_hashes(seq, page):
                    for tenant in (s.tenant, None):
                        holders = firsts.setdefault((tenant, h), [])
                        if s.index not in holders and len(holders) < 2:
                            holders.append(s.index)
        public = len(self.public) // page

        def depth(tenant: str | None, s: Sent) -> int:
            k = 0
            for h in _page_hashes(s.prompt, page):
                holders = firsts.get((tenant, h), [])
                if not any(i != s.index and i < s.answered_after for i in holders):
                    break
                k += 1
            return k

        out = []
        for s in self.sent:
            if not s.cached:
                continue
            credited = -(-s.cached // page)
            own = max(min(_lcp(s.prompt, self.public) // page, public), depth(s.tenant, s))
            if own < credited <= depth(None, s):
                out.append(
                    {"tenant": s.tenant, "index": s.index, "cached": s.cached,
                     "own_pages": own, "page": page}  # fmt: skip
                )
        return out

    def repeat_hit_rate(self, page: int) -> tuple[int, int]:
        """(answered repeat turns, those credited with a cached page of their own history past
        the public prefix): how often the cache served a conversation's next turn."""
        public = len(self.public) // page
        turns = [s for s in self.sent if s.turn > 0 and s.cached is not None]
        hits = sum(
            1
            for s in turns
            if s.cached // page > min(_lcp(s.prompt, self.public) // page, public)
        )
        return len(turns), hits


def _page_hashes(seq: tuple[int, ...], page: int) -> list[int]:
    """A chained hash per full page: equal at k iff the first k pages are (bar a 64-bit
    collision), without keeping every prefix."""
    out, h = [], 0
    for k in range(len(seq) // page):
        h = hash((h, seq[k * page : (k + 1) * page]))
        out.append(h)
    return out


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Mix:
    """The soak's traffic generator: shared by its client threads."""

    tenants: dict[str, str]  # key -> tenant
    ctx: int
    model: str
    encode: Callable[[str], list[int]]  # no special tokens
    bos: list[int]
    registry: CanaryRegistry
    ledger: Ledger
    tally: Tally
    public_ids: list[int]
    system_ids: list[int]
    over_share: float = 0.05
    cut_share: float = 0.15
    logprobs_share: float = 0.05
    heads: tuple[tuple[str, int], ...] = HEADS
    mismatches: list[dict] = field(default_factory=list)
    restarting: threading.Event = field(default_factory=threading.Event)
    _n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_id(self) -> int:
        with self._lock:
            self._n += 1
            return self._n

    def conversation(self, rng: random.Random) -> Conversation:
        key, tenant = rng.choice(sorted(self.tenants.items()))
        head = rng.choices([h for h, _ in self.heads], [w for _, w in self.heads])[0]
        ids = list(self.bos)
        if "public" in head:
            ids = list(self.public_ids)
        if "system" in head:
            ids += self.system_ids
        cid = f"conv-{self.next_id()}"
        self.registry.register(tenant, cid)
        return Conversation(tenant, key, cid, head, ids, turns_left=rng.randint(2, 6))

    def turn_ids(self, conv: Conversation, rng: random.Random, target: int) -> list[int]:
        count = lambda text: len(self.encode(text))  # noqa: E731
        p = build_prompt(self.registry, conv.tenant, conv.cid, target, rng=rng, count_tokens=count)
        return self.encode(("\n" if conv.turn else "") + p.text)

    def step(self, url: str, conv: Conversation | None, rng: random.Random) -> Conversation | None:
        """One request of conv (a new conversation if None or done); the conversation to go on
        with, or None when it ended."""
        for _ in range(8):
            if conv is None or conv.turns_left <= 0:
                conv = self.conversation(rng)
            max_tokens = rng.randint(4, 16)
            room = self.ctx - len(conv.ids) - max_tokens - 2  # - the turn's leading newline
            over = rng.random() < self.over_share
            if over:  # past the context: a 400 before anything is cached or transferred
                target = max(room, 0) + rng.randint(8, 120)
            elif room >= 24:
                target = rng.randint(16, min(room, 96))
            else:
                conv = None  # full: a new conversation
                continue
            prompt = conv.ids + self.turn_ids(conv, rng, target)
            over = len(prompt) + max_tokens > self.ctx
            break
        else:
            raise RuntimeError("no turn fits the context: --context-length too small")
        sent = self.ledger.send(conv.tenant, prompt, conv.turn)
        output = self.request(url, conv, prompt, max_tokens, over, rng, sent)
        conv.turns_left -= 1
        if output is None:
            return None if over else conv
        conv.ids = prompt + output
        conv.turn += 1
        return conv

    def request(
        self,
        url: str,
        conv: Conversation,
        prompt: list[int],
        max_tokens: int,
        over: bool,
        rng: random.Random,
        sent: Sent,
    ) -> list[int] | None:
        """Send one turn; its output token ids when it was answered whole, else None."""
        stream = rng.random() < 0.5
        cut = rng.random() < self.cut_share
        body: dict = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        elif rng.random() < self.logprobs_share:
            body["prompt_logprobs"] = 0  # PD: drop_prompt_logprobs must fail closed, never 200
        rid = f"{conv.cid}-t{conv.turn}-{sent.index}"
        headers = {"Authorization": f"Bearer {conv.key}", "X-Request-Id": rid}
        text, ids, usage = "", [], None
        try:
            if stream:
                with httpx.stream(
                    "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S
                ) as r:
                    if r.status_code != 200:
                        r.read()
                        self._error(r, r.status_code, rid, conv)
                        return None
                    finished, stop_at = False, rng.randint(1, 3) if cut else None
                    for event in iter_events(r.iter_bytes()):
                        if event.done:
                            finished = True
                            break
                        obj = event.json()
                        if "error" in obj:
                            err = obj["error"]
                            self._check(None, err, None, rid)
                            self.tally.add(f"stream_error_{err.get('code')}")
                            return None
                        if obj.get("usage"):
                            usage = obj["usage"]
                        for c in obj.get("choices", []):
                            text += c["text"]
                            ids += _ids(c)
                        if stop_at is not None and len(ids) >= stop_at:
                            self.tally.add("client_cut_stream")
                            return None
                    if not finished:
                        self.tally.add("stream_ended_without_done")
                        self.tally.short_200.append({"request": rid, "text": text})
                        return None
            else:
                r = httpx.post(
                    f"{url}/v1/completions",
                    json=body,
                    headers=headers,
                    timeout=rng.uniform(0.05, 0.5) if cut else TIMEOUT_S,
                )
                if r.status_code != 200:
                    self._error(r, r.status_code, rid, conv)
                    return None
                choice = r.json()["choices"][0]
                text, ids, usage = choice["text"], _ids(choice), r.json()["usage"]
            if over:
                self.tally.short_200.append({"request": rid, "why": "over-length prompt got 200"})
            if usage is None or usage["completion_tokens"] != max_tokens or len(ids) != max_tokens:
                self.tally.short_200.append({"request": rid, "usage": usage, "ids": len(ids)})
                return None
            self.tally.add("ok_200")
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            self.ledger.answer(sent, cached, ids)
            return ids
        except httpx.TimeoutException:
            self.tally.add("client_timeout" if cut else "unexpected_timeout")
        except httpx.TransportError as e:
            # A unified server restarting refuses connections until it listens again.
            kind = "refused_while_restarting" if self.restarting.is_set() else "client_error"
            self.tally.add(f"{kind}_{type(e).__name__}")
        finally:
            for leak in self.registry.find_leaks(text, conv.cid, conv.tenant):
                with self.tally.lock:
                    self.tally.leaks.append(leak.as_dict())
        return None

    def _error(self, r: httpx.Response, status: int, rid: str, conv: Conversation) -> None:
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = {"code": None, "type": None, "message": r.text[:200]}
        self._check(status, err, r.headers.get("retry-after"), rid)
        self.tally.add(f"http_{status}_{err.get('code')}")
        # An error message must not carry anyone's canary either.
        for leak in self.registry.find_leaks(str(err.get("message")), conv.cid, conv.tenant):
            with self.tally.lock:
                self.tally.leaks.append(leak.as_dict())

    def _check(self, status: int | None, err: dict, retry_after: str | None, rid: str) -> None:
        why = table_mismatch(status, str(err.get("code")), str(err.get("type")), retry_after)
        if why is not None:
            with self._lock:
                self.mismatches.append({"request": rid, "why": why})


def _ids(choice: dict) -> list[int]:
    tokens = (choice.get("logprobs") or {}).get("tokens") or []
    return [int(t.split(":", 1)[1]) for t in tokens]
