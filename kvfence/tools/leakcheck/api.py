"""The only part of `kvfence leakcheck` that talks to the server: discovery (`/v1/models`), the
tokenizer endpoint, and one request (plain or streamed, optionally cut) read into a `Reply`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvfence.sse import aiter_events
from kvfence.tools.leakcheck.common import CannotRun, Tenant

CONTEXT_FIELDS = ("max_model_len", "context_length", "max_context_length")
KEEPALIVE_S = 1.0


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
    # A 2xx body that is an answer (choices, or a stream event that carries them or usage).
    # A 2xx without one (a proxy's HTML page, a stream cut before its first event) says
    # nothing about what the server computed.
    answered: bool = True


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
            # A pooled connection idle for as long as the server keeps it alive (uvicorn's 5 s,
            # which vLLM, SGLang and kvfence keep; also httpx's own default expiry) can be
            # closed by the server while our next request is in flight: the kernel then resets
            # it and the request fails with a ReadError the server never saw (a late timer on a
            # loaded machine widens that window). Reuse only connections idle well under that.
            limits=httpx.Limits(max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S),
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

    async def tokenize(self, tenant: Tenant, text: str, *, chat: bool = False) -> int | None:
        """vLLM's (and SGLang's) tokenizer endpoint, when the server has one; `chat`: the
        count of `text` as one user message, chat template included (vLLM's `messages`)."""
        body: dict[str, Any] = {"model": self.model}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        got = await self._post_json(("/tokenize", "/v1/tokenize"), body, tenant)
        if got is None:
            return None
        count, ids = got.get("count"), got.get("tokens")
        if isinstance(count, int) and not isinstance(count, bool):
            return count
        if isinstance(ids, list):
            return len(ids)
        return None

    async def token_ids(self, tenant: Tenant, text: str) -> list[int] | None:
        """`text`'s token ids without the special tokens a prompt gets (vLLM's `/tokenize`
        with add_special_tokens false), or None when the server has no such endpoint."""
        body: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        got = await self._post_json(("/tokenize", "/v1/tokenize"), body, tenant)
        ids = got.get("tokens") if got else None
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return [int(i) for i in ids]
        return None

    async def detokenize(self, tenant: Tenant, ids: list[int]) -> str | None:
        """vLLM's `/detokenize`: the text of these token ids, or None (no endpoint, bad ids)."""
        body: dict[str, Any] = {"tokens": ids}
        got = await self._post_json(("/detokenize", "/v1/detokenize"), body, tenant)
        text = got.get("prompt") if got else None
        return text if isinstance(text, str) else None

    async def _post_json(
        self, paths: tuple[str, ...], body: dict[str, Any], tenant: Tenant
    ) -> dict[str, Any] | None:
        if self.model:
            body = {"model": self.model, **body}
        for path in paths:
            try:
                r = await self.client.post(path, json=body, headers=self._headers(tenant))
            except httpx.HTTPError:
                return None
            if r.status_code != 200:
                continue
            try:
                got = r.json()
            except ValueError:
                continue
            if isinstance(got, dict):
                return got
        return None

    async def timed(
        self, tenant: Tenant, text: str, *, chat: bool, stream: bool, extra: dict[str, Any]
    ) -> tuple[float | None, int | None, str | None]:
        """(seconds to the first SSE event, or to the whole answer when not streamed; status;
        error) of a 1-token request. None seconds: it failed or carried no event."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": 1, "temperature": 0, **extra}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = self._headers(tenant)
        start = time.perf_counter()
        try:
            if not stream:
                r = await self.client.post(path, json=body, headers=headers)
                dt = time.perf_counter() - start
                return (dt if r.status_code == 200 else None), r.status_code, r.text[:200]
            body["stream"] = True
            async with self.client.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    return None, r.status_code, (await r.aread()).decode(errors="replace")[:200]
                first = None
                async for _ in aiter_events(r.aiter_bytes()):
                    # Read to the end (a 1-token answer): the connection stays reusable.
                    first = first if first is not None else time.perf_counter() - start
                return first, 200, None if first is not None else "a stream without events"
        except httpx.HTTPError as e:
            return None, None, f"{type(e).__name__}: {e}"[:200]

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
            where = "before the status line" if stream else "no complete answer"
            return Reply(None, error=f"{type(e).__name__}: {e} ({where})"[:300])

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
            reply = Reply(200, answered=False)
            chunks = 0
            try:
                async for ev in aiter_events(r.aiter_bytes()):
                    if ev.done:
                        break
                    try:
                        event = ev.json()
                    except ValueError:
                        continue
                    if not isinstance(event, dict):
                        continue
                    _apply_event(reply, event, chat)
                    chunks += 1
                    if cut_after is not None and chunks >= cut_after:
                        # Leaving the block closes the connection mid-answer: a client hang-up.
                        reply.cancelled = True
                        break
            except httpx.HTTPError as e:
                # Keep what was read (it is checked for leaks too) and say where it broke: a
                # transport error before the status line never reached the server's handler.
                reply.status = None
                reply.error = f"{type(e).__name__}: {e} (after {chunks} events of a 200 stream)"
            return reply


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _int(x: Any, default: int | None) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else default


def _choice_text(choice: Any, chat: bool, key: str) -> str:
    """A choice's text (completions) or its message / delta content (chat); "" otherwise."""
    c = _dict(choice)
    text = _dict(c.get(key)).get("content") if chat else c.get("text")
    return text if isinstance(text, str) else ""


def _apply_event(reply: Reply, event: dict[str, Any], chat: bool) -> None:
    sid = event.get("id")
    reply.server_id = reply.server_id or (sid if isinstance(sid, str) else None)
    if "error" in event:  # an error inside a 200 stream
        reply.error = str(event["error"])[:300]
    choices = event.get("choices")
    reply.answered = reply.answered or isinstance(choices, list) or "usage" in event
    for choice in choices if isinstance(choices, list) else []:
        reply.text += _choice_text(choice, chat, "delta")
    usage = _dict(event.get("usage"))
    reply.prompt_tokens = _int(usage.get("prompt_tokens"), reply.prompt_tokens)
    reply.completion_tokens = _int(usage.get("completion_tokens"), reply.completion_tokens)


def _parse_reply(r: httpx.Response, chat: bool) -> Reply:
    try:
        body = r.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return Reply(r.status_code, error=f"non-JSON body: {r.text[:200]!r}", answered=False)
    if r.status_code >= 300:
        err = body.get("error")
        if isinstance(err, dict):
            message, code = str(err.get("message", "")), err.get("code")
        elif err is None and isinstance(body.get("message"), str):  # SGLang's ErrorResponse
            message, code = body["message"], body.get("code")
        else:
            message, code = str(err or body.get("detail") or body)[:500], None
        where = ""
        if r.is_redirect:
            where = f" (redirect to {r.headers.get('location')!r} not followed)"
        return Reply(r.status_code, error=message + where, error_code=str(code) if code else None)
    sid = body.get("id")
    reply = Reply(r.status_code, server_id=sid if isinstance(sid, str) else None)
    choices = body.get("choices")
    reply.answered = isinstance(choices, list)
    for choice in choices if isinstance(choices, list) else []:
        reply.text += _choice_text(choice, chat, "message")
    usage = _dict(body.get("usage"))
    reply.prompt_tokens = _int(usage.get("prompt_tokens"), None)
    reply.completion_tokens = _int(usage.get("completion_tokens"), None)
    return reply
