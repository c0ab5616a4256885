"""The relay: sends one client request to a decode (with its paired prefill's address) and passes
the answer back byte for byte; a stream is cut only at event boundaries, and an answer that ends
early ends in an error event, never in a bare end that reads as complete (I5)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvfence import sse
from kvfence.server.drain import NOT_ADMITTED_HEADER
from kvfence.server.errors import APIError, upstream_failure
from kvfence.server.hop import HEADER_PREFILL, sign_prefill
from kvfence.server.request_id import client_request_id
from kvfence.server.router.prefix_index import PrefixKey
from kvfence.server.router.state import RouterState, no_workers
from kvfence.server.router.workers import Worker
from kvfence.sse import Event, SSEParser

logger = logging.getLogger("kvfence.router")


# An allowlist, not a denylist: only what an OpenAI client legitimately sends travels on, so no
# spelling of an X-Kvfence-* header (or anything else a worker might trust) gets through.
_FORWARDED_REQUEST_HEADERS = frozenset(
    {
        "authorization",
        "content-type",
        "accept",
        "user-agent",
        "x-request-id",
        "openai-organization",
        "openai-project",
    }
)
# Bodies are re-framed by our server (length or chunking) and decoded by httpx.
_DROPPED_RESPONSE_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
        NOT_ADMITTED_HEADER.lower(),
    }
)


# A decode's 503 codes that mean its paired prefill refused the room because it is draining, or
# could not be reached at all.
_PREFILL_GONE = frozenset({"draining", "prefill_unavailable"})
# The last event of a whole Responses API stream (vLLM sends `response.completed` for answers
# cut by max_output_tokens too, with status "incomplete").
_RESPONSES_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _unreachable() -> APIError:
    return upstream_failure("upstream_unreachable", "Could not connect to a decode worker.")


class _SSECutter:
    """Passes an event stream on at event boundaries (kvfence.sse's parser decides them), so a
    cut upstream never leaves half an event in front of our error event, and remembers whether
    the stream ended the way OpenAI's do."""

    def __init__(self) -> None:
        self._parser = SSEParser()
        self.last: Event | None = None

    def feed(self, chunk: bytes) -> bytes:
        ready, events = self._parser.split(chunk)
        if events:
            self.last = events[-1]
        return ready

    @property
    def ended_cleanly(self) -> bool:
        """True when the last event was [DONE], the worker's own error event, or the event that
        ends a Responses API stream (which has no [DONE])."""
        if self._parser.pending.strip() or self.last is None:
            return False
        if self.last.done:
            return True
        try:
            obj = self.last.json()
        except ValueError:
            return False
        if not isinstance(obj, dict):
            return False
        return "error" in obj or (
            self.last.event == obj.get("type") and obj.get("type") in _RESPONSES_ENDS
        )


def _sse_error(err: APIError) -> bytes:
    return sse.encode(err.body())


def request_headers(request: Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_REQUEST_HEADERS}
    # Plain bytes from the worker keep event boundaries visible to _SSECutter.
    headers["accept-encoding"] = "identity"
    return headers


def _response_headers(r: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [
        (k.lower().encode("latin-1"), v.encode("latin-1"))
        for k, v in r.headers.multi_items()
        if k.lower() not in _DROPPED_RESPONSE_HEADERS
    ]


@dataclass
class _Progress:
    status: int | None = None  # what we sent the client, once we have
    sse: bool = False
    done: bool = False
    client_gone: bool = False
    decode: Worker | None = None
    prefill: Worker | None = None
    extra: list[str] = field(default_factory=list)


class Relay(Response):
    """Sends one client request to a decode and relays its answer. Returned by a route, it runs as
    the ASGI response, where it can watch the client: a hang-up cancels the relay, and the relay's
    cleanup closes the upstream connection, which is how the decode learns to abort its transfer."""

    def __init__(
        self,
        state: RouterState,
        method: str,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        paired: bool,
        route: str | None = None,
        prefix: PrefixKey | None = None,
    ) -> None:
        super().__init__()
        self._state = state
        self._method = method
        self._path = path
        self._route = route or path  # the metric label: bounded, unlike paths with model ids
        self._body = body
        self._headers = headers
        self._paired = paired
        self._prefix = prefix
        self._p = _Progress()
        self._held: list[Worker] = []
        self._draining: bytes | None = None  # a draining decode's 503 body, if one refused us
        self._draining_headers: list[tuple[bytes, bytes]] = []  # ... and its Retry-After

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.monotonic()
        p = self._p
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_client, receive, tg.cancel_scope)
                await self._run(send)
                tg.cancel_scope.cancel()
        finally:
            status = p.status if p.status is not None else 499  # nginx: client closed request
            self._state.metrics.requests.labels(path=self._route, status=str(status)).inc()
            logger.info(
                "%s %s status=%d client_request_id=%s decode=%s prefill=%s client_gone=%s%s "
                "duration_s=%.4f",
                self._method,
                self._path,
                status,
                client_request_id(scope),
                p.decode.name if p.decode else "-",
                p.prefill.name if p.prefill else "-",
                p.client_gone,
                "".join(" " + e for e in p.extra),
                time.monotonic() - start,
            )

    async def _watch_client(self, receive: Receive, cancel: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            # After our last byte the server reports a disconnect too; that one is no hang-up.
            if message["type"] == "http.disconnect":
                if not self._p.done:
                    self._p.client_gone = True
                    cancel.cancel()
                return

    async def _run(self, send: Send) -> None:
        p = self._p
        with anyio.move_on_after(self._state.settings.request_timeout) as deadline:
            try:
                await self._attempts(send)
            except Exception:  # a bug here must still end the request with an error
                logger.exception("router relay failed on %s", self._path)
                p.extra.append("error=internal")
                await self._fail(send, upstream_failure("internal", "Internal router error."))
        if deadline.cancelled_caught:
            p.extra.append("error=timeout")
            msg = f"The request did not finish within {self._state.settings.request_timeout:g} s."
            await self._fail(send, upstream_failure("upstream_timeout", msg))

    async def _attempts(self, send: Send) -> None:
        st, p = self._state, self._p
        tried: list[Worker] = []
        for attempt in range(2):
            decode, prefill = self._pick(tried)
            if decode is None:
                await self._give_up(send, _unreachable() if tried else no_workers())
                return
            p.decode, p.prefill = decode, prefill
            headers = dict(self._headers)
            if prefill is not None:
                address = prefill.bootstrap or ""
                key = st.operator_key
                # Signed, so a decode knows the address is ours and not a client's word.
                headers.update(sign_prefill(key, address) if key else {HEADER_PREFILL: address})
            self._hold(prefill, decode)
            try:
                if await self._exchange(send, decode, headers):
                    return
                # Nothing reached that decode's engine: safe to send the request elsewhere, once.
                tried.append(decode)
                if attempt == 0:
                    st.metrics.retries.inc()
                    p.extra.append(f"retried_from={decode.name}")
            finally:
                self._release()
        await self._give_up(send, _unreachable())

    async def _give_up(self, send: Send, err: APIError) -> None:
        if self._draining is not None:  # the clearer news: the worker is shutting down
            headers = [(b"content-type", b"application/json"), *self._draining_headers]
            await self._whole(send, 503, headers, self._draining)
        else:
            await self._send_error(send, err)

    def _pick(self, tried: list[Worker]) -> tuple[Worker | None, Worker | None]:
        """A decode and the prefill it pairs with, by the routing policy; or a decode alone."""
        st = self._state
        if not self._paired:
            return st.decode.pick(exclude=tried), None
        pair = st.routing.pick_pair(self._prefix, exclude=tried)
        return (pair.decode.worker, pair.prefill.worker) if pair else (None, None)

    def _hold(self, *workers: Worker | None) -> None:
        # The prefill is counted busy for the whole answer: the router cannot see when the
        # decode is done with it, and over-counting only spreads load a little more.
        self._held = [w for w in workers if w is not None]
        for w in self._held:
            w.in_flight += 1

    def _release(self) -> None:
        """Idempotent; called as soon as the upstream is finished, before our last byte, so a
        client's next request already sees the load it left behind."""
        for w in self._held:
            w.in_flight -= 1
        self._held = []

    async def _exchange(self, send: Send, decode: Worker, headers: dict[str, str]) -> bool:
        """False only when the connection failed before any byte left (the caller may retry)."""
        st = self._state
        request = st.proxy.build_request(
            self._method, decode.url + self._path, content=self._body or None, headers=headers
        )
        try:
            upstream = await st.proxy.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            st.metrics.upstream_errors.labels(worker=decode.url, kind="connect").inc()
            st.mark_down(decode, f"connect failed: {type(e).__name__}: {e}")
            return False
        except httpx.HTTPError as e:
            st.metrics.upstream_errors.labels(worker=decode.url, kind=_kind(e)).inc()
            self._p.extra.append(f"upstream_error={_kind(e)}")
            await self._send_error(
                send,
                upstream_failure(
                    "upstream_failed",
                    f"The decode worker failed before answering ({type(e).__name__}).",
                ),
            )
            return True
        if upstream.status_code == 503 and upstream.headers.get(NOT_ADMITTED_HEADER):
            # Draining: it refused at its door, before any engine saw the request.
            try:
                self._draining = await upstream.aread()
                after = upstream.headers.get("retry-after")
                self._draining_headers = [(b"retry-after", after.encode())] if after else []
            except httpx.HTTPError:
                self._draining = None
            finally:
                await upstream.aclose()
            st.mark_down(decode, "draining (refused a request at admission)")
            self._p.extra.append(f"draining={decode.name}")
            return False
        try:
            await self._relay(send, decode, upstream)
        finally:
            # Shielded: on a client hang-up this runs inside a cancelled scope, and the close is
            # the whole point (it is what tells the decode to abort).
            with anyio.CancelScope(shield=True):
                await upstream.aclose()
        return True

    async def _relay(self, send: Send, decode: Worker, upstream: httpx.Response) -> None:
        st, p = self._state, self._p
        headers = _response_headers(upstream)
        if not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                body = await upstream.aread()
            except httpx.HTTPError as e:
                # Nothing sent yet: the client gets a real error status, never a cut 200.
                st.metrics.upstream_errors.labels(worker=decode.url, kind=_kind(e)).inc()
                p.extra.append(f"upstream_error={_kind(e)}")
                await self._send_error(
                    send,
                    upstream_failure(
                        "upstream_failed", "The decode worker failed while answering."
                    ),
                )
                return
            self._release()
            if upstream.status_code == 503:
                self._note_prefill_gone(body)
            await self._whole(send, upstream.status_code, headers, body)
            return
        p.sse = True
        await self._start(send, upstream.status_code, headers)
        cutter = _SSECutter()
        try:
            async for chunk in upstream.aiter_bytes():
                ready = cutter.feed(chunk)
                if ready:
                    await self._body_part(send, ready, more=True)
        except httpx.HTTPError as e:
            st.metrics.upstream_errors.labels(worker=decode.url, kind=_kind(e)).inc()
            p.extra.append(f"upstream_error={_kind(e)}")
        self._release()
        # I5: a cut answer ends in an error event, never a bare end that reads as complete.
        tail = (
            b""
            if cutter.ended_cleanly
            else _sse_error(
                upstream_failure(
                    "upstream_failed",
                    "The decode worker stopped before the answer was complete.",
                )
            )
        )
        await self._end_stream(send, tail)

    def _note_prefill_gone(self, body: bytes) -> None:
        """The decode says its prefill is draining or gone: out of rotation now, not at the next
        health poll, so the requests behind this one pair elsewhere. The poll brings it back."""
        prefill = self._p.prefill
        if prefill is None:
            return
        try:
            code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return
        if code in _PREFILL_GONE:
            self._state.mark_down(prefill, f"a decode reported {code}")

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._p.status = status
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body_part(self, send: Send, body: bytes, *, more: bool) -> None:
        message: Message = {"type": "http.response.body", "body": body, "more_body": more}
        if not more:
            self._p.done = True
        await send(message)

    async def _whole(
        self, send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        # Shielded so a deadline cannot fall between status and body; a send to a client that
        # has gone returns at once, so this cannot hang.
        with anyio.CancelScope(shield=True):
            await self._start(send, status, [*headers, (b"content-length", b"%d" % len(body))])
            await self._body_part(send, body, more=False)

    async def _end_stream(self, send: Send, tail: bytes) -> None:
        with anyio.CancelScope(shield=True):
            if tail:
                await self._body_part(send, tail, more=True)
            await self._body_part(send, b"", more=False)

    async def _send_error(self, send: Send, err: APIError) -> None:
        body = json.dumps(err.body()).encode()
        extra = [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
        await self._whole(send, err.status, [(b"content-type", b"application/json"), *extra], body)

    async def _fail(self, send: Send, err: APIError) -> None:
        """An error whatever has been sent already: a status if we can, else an SSE event."""
        p = self._p
        if p.done:
            return
        if p.status is None:
            await self._send_error(send, err)
        elif p.sse:
            await self._end_stream(send, _sse_error(err))


def _kind(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    if isinstance(e, httpx.RemoteProtocolError):
        return "protocol"
    if isinstance(e, httpx.TransportError):
        return "transport"
    return "http"
