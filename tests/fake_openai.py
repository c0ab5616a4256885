"""Fake OpenAI-compatible servers for leakcheck's tests (httpx.MockTransport handlers, no sockets).

`WordingServer` is a perfect-recall model with correct admission that refuses over-length
prompts in the words of a chosen server (vLLM 0.32's "at least N", SGLang, OpenAI, ...), with
or without a `/tokenize` endpoint, and with a tokenizer that can disagree with leakcheck's
estimate. `CachingServer` (for the timing probe) charges simulated compute time for every
prompt token not already in its prefix cache, with the cache per tenant or shared."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import types
import unittest.mock
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

KEYS = {"key-alpha": "alpha", "key-beta": "beta"}

# One refusal per style, in that server's words; `{n}` is what the server says it counted.
STYLES = {
    "vllm-0.32": (
        "This model's maximum context length is {ctx} tokens. However, you requested {m} "
        "output tokens and your prompt contains at least {n} input tokens, for a total of at "
        "least {t} tokens. Please reduce the length of the input prompt or the number of "
        "requested output tokens. (parameter=input_tokens, value={n})"
    ),
    "vllm-main": (
        "You passed {n} input tokens and requested {m} output tokens. However, the model's "
        "context length is only {ctx} tokens, resulting in a maximum input length of {i} "
        "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        "value={n})"
    ),
    "vllm-0.10": (
        "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum "
        "context length is {ctx} tokens and your request has {n} input tokens ({m} > {ctx} - {n})."
    ),
    "vllm-0.6": (
        "This model's maximum context length is {ctx} tokens. However, you requested {t} tokens "
        "({n} in the messages, {m} in the completion). Please reduce the length of the messages "
        "or completion."
    ),
    "openai": (
        "This model's maximum context length is {ctx} tokens. However, your messages resulted "
        "in {n} tokens. Please reduce the length of the messages."
    ),
    "sglang": (
        "Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
        "requested a total of {t} tokens: {n} tokens from the input messages and {m} tokens for "
        "the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    ),
    "kvfence": (
        "This model's maximum context length is {ctx} tokens. However, your prompt has {n} "
        "tokens, leaving no room for a completion."
    ),
    "unknown": "Request too large for this deployment.",
}
# Styles whose servers stop counting past the limit: they state a lower bound.
TRUNCATING = {"vllm-0.32", "vllm-main"}
CHAT_TEMPLATE_TOKENS = 6
NO_CHAT_TEMPLATE = (
    "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
    "a chat template if the tokenizer does not define one."
)


def tenant_of(request: httpx.Request) -> str | None:
    return KEYS.get(request.headers.get("authorization", "").removeprefix("Bearer "))


class WordingServer:
    """Correct admission (prompt + max_tokens <= ctx, at least one new token), a model that
    answers `key:` cues from its own prompt, refusals worded as `style`.

    `chars_per_token`: the tokenizer's rate for short texts; `long_chars_per_token` (if given)
    applies past the first 400 characters, so a rate learned from a short prompt misjudges a
    long one (a tokenizer that disagrees with leakcheck's estimate)."""

    def __init__(
        self,
        style: str,
        *,
        ctx: int = 512,
        tokenize: bool = True,
        chars_per_token: float = 2.0,
        long_chars_per_token: float | None = None,
        sglang_body: bool = False,
        chat_template: bool = True,
    ) -> None:
        self.style = style
        self.chat_template = chat_template
        self.ctx = ctx
        self.tokenize_endpoint = tokenize
        self.cpt = chars_per_token
        self.long_cpt = long_chars_per_token
        self.sglang_body = sglang_body or style == "sglang"
        self.seen = 0

    def tokens(self, text: str) -> int:
        if self.long_cpt is None or len(text) <= 400:
            return math.ceil(len(text) / self.cpt)
        return math.ceil(400 / self.cpt) + math.ceil((len(text) - 400) / self.long_cpt)

    def _refusal(self, n: int, m: int) -> httpx.Response:
        said = min(n, self.ctx - m + 1) if self.style in TRUNCATING else n
        msg = STYLES[self.style].format(ctx=self.ctx, n=said, m=m, t=said + m, i=self.ctx - m)
        if self.sglang_body:  # SGLang's ErrorResponse puts the message at the top level
            body = {"object": "error", "message": msg, "type": "BadRequest", "code": 400}
        else:
            body = {"error": {"message": msg, "type": "BadRequestError", "code": 400}}
        return httpx.Response(400, json=body)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if tenant_of(request) is None:
            return httpx.Response(401, json={"error": {"message": "bad key", "code": "auth"}})
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": self.ctx}]})
        if path in ("/tokenize", "/v1/tokenize"):
            if not self.tokenize_endpoint:  # e.g. behind a proxy that only passes /v1/*
                return httpx.Response(404, json={"detail": "Not Found"})
            body = json.loads(request.content)
            if "messages" in body:
                n = self.tokens(body["messages"][0]["content"]) + CHAT_TEMPLATE_TOKENS
            else:
                n = self.tokens(body["prompt"])
            return httpx.Response(200, json={"count": n, "max_model_len": self.ctx})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return httpx.Response(404, json={"error": {"message": "no route"}})
        self.seen += 1
        body = json.loads(request.content)
        chat = "messages" in body
        if chat and not self.chat_template:  # vLLM's refusal, vllm/entrypoints/chat_utils.py
            err = {"message": NO_CHAT_TEMPLATE, "type": "BadRequestError", "code": 400}
            return httpx.Response(400, json={"error": err})
        text = body["messages"][0]["content"] if chat else body["prompt"]
        n = self.tokens(text) + (CHAT_TEMPLATE_TOKENS if chat else 0)
        m = body.get("max_tokens")
        if n + (m if m is not None else 1) > self.ctx:
            return self._refusal(n, m if m is not None else 0)
        return _answer(text, chat, body, n, m if m is not None else self.ctx - n)


def _answer(text: str, chat: bool, body: dict[str, Any], n: int, m: int) -> httpx.Response:
    cue = text.rsplit("\n", 1)[-1].removesuffix(":")
    # A scan, not a regex per cue: `re` caches compiled patterns across requests, a prompt cache
    # shared across tenants that the timing probe would rightly report.
    found = [v for line in text.split("\n") if (v := line.removeprefix(f"{cue}: ")) != line]
    answer = f" {found[0].split()[0]}\n" if found and found[0].split() else " nothing\n"
    usage = {"prompt_tokens": n, "completion_tokens": min(m, 12)}
    if body.get("stream"):
        key = "delta" if chat else "text"
        piece = {"content": answer} if chat else answer
        events = [{"id": "x", "choices": [{key: piece}]}, {"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(e)}\r\n\r\n" for e in events) + "data: [DONE]\r\n\r\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
    choice = {"message": {"content": answer}} if chat else {"text": answer}
    return httpx.Response(200, json={"id": "x", "choices": [choice], "usage": usage})


# A word-level vocabulary: id 0 is the unknown token, then 1,000 words.
VOCAB = ["<unk>", *(f"w{i}" for i in range(1000))]
WORDS = {w: i for i, w in enumerate(VOCAB) if i}


class CachingServer:
    """A server with a prefix cache: each prompt token not already cached costs `per_token_s`
    of simulated compute before the first token (awaited, so concurrent requests overlap).

    `cache=False`: no cache at all. `shared=True`: one cache for every tenant (the leak);
    False: one namespace per tenant. `salt_field`: a request's salt (that body field) is part of
    the namespace, as vLLM's cache_salt is; `salt_ignored=True` drops it (the salt is lost on
    the way). Caching is per whole prompt, which is what the probe's prompts need.
    `word_level=True`: a word-level tokenizer (VOCAB) with `/tokenize` ids and `/detokenize`;
    the cache keys on token ids, so prompts of words it does not know are all one prompt.

    Time as the client measures it is `now()`, a clock this server keeps: each request moves it
    on by its simulated compute plus a seeded jitter of up to `jitter_s`, so a timing verdict
    depends on the seed alone, never on how loaded the machine running the test is
    (`measured_by` puts leakcheck's timer on this clock, and while it does the server answers
    without waiting out the simulated compute: the wait would add wall time and nothing else)."""

    def __init__(
        self,
        *,
        ctx: int = 2048,
        cache: bool = True,
        shared: bool = False,
        per_token_s: float = 0.0004,
        salt_field: str | None = None,
        salt_ignored: bool = False,
        word_level: bool = False,
        jitter_s: float = 0.01,
        seed: int = 0,
    ) -> None:
        self.word_level = word_level
        self.ctx = ctx
        self.cache = cache
        self.shared = shared
        self.per_token_s = per_token_s
        self.salt_field = salt_field
        self.salt_ignored = salt_ignored
        self.cached: set[tuple[str, str]] = set()
        self.seen = 0
        self.jitter_s = jitter_s
        self._rng = random.Random(seed)
        self._now = 0.0
        self._sleeps = True  # off while leakcheck reads this clock: waiting adds nothing then

    def now(self) -> float:
        return self._now

    @contextlib.contextmanager
    def measured_by(self) -> Iterator[None]:
        """Within it, leakcheck times its requests on this server's clock."""
        clock = types.SimpleNamespace(perf_counter=self.now)
        self._sleeps = False
        try:
            with unittest.mock.patch("kvfence.tools.leakcheck.api.time", clock):
                yield
        finally:
            self._sleeps = True

    def ids(self, text: str) -> list[int]:
        """Word level: one id per whitespace word, 0 (unknown) for a word not in WORDS."""
        return [WORDS.get(w, 0) for w in text.split()]

    def tokens(self, text: str) -> int:
        return len(self.ids(text)) if self.word_level else math.ceil(len(text) / 2)

    def _key(self, text: str) -> str:
        # What a cache keys on is tokens: under a word-level vocabulary, unknown words are alike.
        return " ".join(map(str, self.ids(text))) if self.word_level else text

    def _namespace(self, tenant: str, body: dict[str, Any]) -> str:
        ns = "" if self.shared else tenant
        if self.salt_field and not self.salt_ignored:
            ns += "/" + str(body.get(self.salt_field, ""))
        return ns

    async def handle(self, request: httpx.Request) -> httpx.Response:
        tenant = tenant_of(request)
        if tenant is None:
            return httpx.Response(401, json={"error": {"message": "bad key"}})
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": self.ctx}]})
        if path == "/tokenize":
            body = json.loads(request.content)
            text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
            if self.word_level:  # vLLM's shape, token ids included
                ids = self.ids(text)
                return httpx.Response(200, json={"count": len(ids), "tokens": ids})
            return httpx.Response(200, json={"count": self.tokens(text)})
        if path == "/detokenize" and self.word_level:
            ids = json.loads(request.content)["tokens"]
            if any(i > len(WORDS) for i in ids):
                return httpx.Response(400, json={"error": {"message": "token id out of range"}})
            return httpx.Response(200, json={"prompt": " ".join(VOCAB[i] for i in ids)})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return httpx.Response(404, json={"error": {"message": "no route"}})
        self.seen += 1
        body = json.loads(request.content)
        chat = "messages" in body
        text = body["messages"][0]["content"] if chat else body["prompt"]
        n = self.tokens(text)
        m = body.get("max_tokens") or 1
        if n + m > self.ctx:
            msg = f"maximum context length is {self.ctx}. However, your prompt has {n} tokens"
            return httpx.Response(400, json={"error": {"message": msg}})
        key = (self._namespace(tenant, body), self._key(text))
        hit = self.cache and key in self.cached
        if self.cache:
            self.cached.add(key)
        delay = (1 if hit else n) * self.per_token_s
        self._now += delay + self._rng.uniform(0.0, self.jitter_s)
        delay = delay if self._sleeps else 0.0
        # A constant answer: work that depends on the prompt (a regex compiled per cue is cached
        # by `re`) would be a prompt cache of its own, shared across tenants.
        answer = _answer("x: ok\nx:", chat, body, n, m)
        if not body.get("stream"):
            await asyncio.sleep(delay)
            return answer
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            stream=_DelayedStream(delay, answer.content),
        )


class _DelayedStream(httpx.AsyncByteStream):
    """The first event after the simulated prefill; the rest at once."""

    def __init__(self, delay: float, body: bytes) -> None:
        self.delay = delay
        self.body = body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        await asyncio.sleep(self.delay)
        first, sep, rest = self.body.partition(b"\r\n\r\n")
        yield first + sep
        yield rest
