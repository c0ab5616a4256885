"""The PD router: the OpenAI entry point in front of prefill/decode workers. It owns worker health,
least-loaded pairing, room ids, auth at the first door, and byte-exact relay of decode's answer."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from kvfence.pd.pairing import pairing_problem
from kvfence.server.auth import ApiKeyFileError, Authenticator, load_api_keys
from kvfence.server.errors import SERVER_ERROR, APIError, install_handlers

logger = logging.getLogger("kvfence.router")

DEFAULT_HEALTH_INTERVAL_S = 2.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # the workers' own limit: larger bodies would die there
DEFAULT_GRACEFUL_SHUTDOWN_S = 5.0

HEADER_PREFILL = "X-Kvfence-Prefill"
HEADER_ROOM = "X-Kvfence-Room"

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
    }
)
_SSE_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class RouterSettings:
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        for name in ("health_interval", "health_timeout", "request_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")


@dataclass(eq=False)  # identity, not field equality: in_flight changes all the time
class Worker:
    """One worker as the router sees it. Only the event loop touches it, so no locks."""

    url: str
    role: Role
    name: str
    healthy: bool = False
    in_flight: int = 0
    detail: str | None = "not checked yet"
    info: dict[str, Any] | None = None
    bootstrap: str | None = None  # "host:port" of a prefill's transfer bootstrap

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "role": self.role.value,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "bootstrap": self.bootstrap,
            "detail": self.detail,
        }


class WorkerPool:
    """The workers of one role; picks the least-loaded healthy one, ties in round robin."""

    def __init__(self, role: Role, urls: Sequence[str]) -> None:
        self.role = role
        self.workers = [Worker(u, role, f"{role.value}-{i}") for i, u in enumerate(urls)]
        self._rr = 0

    def usable(self, w: Worker) -> bool:
        # A prefill nobody can reach over the transfer protocol is no use to a decode.
        return w.healthy and (self.role is Role.DECODE or w.bootstrap is not None)

    def pick(self, exclude: Sequence[Worker] = (), partner: Worker | None = None) -> Worker | None:
        candidates = [
            w
            for w in self.workers
            if self.usable(w) and w not in exclude and pairing_error(w, partner) is None
        ]
        if not candidates:
            return None
        least = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == least]
        chosen = tied[self._rr % len(tied)]
        self._rr += 1
        return chosen

    def healthy_count(self) -> int:
        return sum(1 for w in self.workers if self.usable(w))


class RouterMetrics:
    def __init__(self, state: RouterState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvfence_router_requests",
            "Client requests by route and HTTP status sent.",
            ["path", "status"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvfence_router_upstream_errors",
            "Failures talking to a worker, by kind.",
            ["worker", "kind"],
            registry=r,
        )
        self.retries = Counter(
            "kvfence_router_retries",
            "Requests re-sent to another decode after a connect error.",
            registry=r,
        )
        r.register(_WorkerCollector(state))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _WorkerCollector(Collector):
    """Reads the pools at scrape time, so the gauges are never stale."""

    def __init__(self, state: RouterState) -> None:
        self._state = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "kvfence_router_workers_healthy", "Workers in rotation, by role.", labels=["role"]
        )
        in_flight = GaugeMetricFamily(
            "kvfence_router_worker_in_flight",
            "Requests the router has open on a worker.",
            labels=["worker", "role"],
        )
        for pool in self._state.pools():
            healthy.add_metric([pool.role.value], float(pool.healthy_count()))
            for w in pool.workers:
                in_flight.add_metric([w.url, pool.role.value], float(w.in_flight))
        yield healthy
        yield in_flight


class RouterState:
    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        api_keys: dict[str, str] | None,
        settings: RouterSettings,
    ) -> None:
        self.prefill = WorkerPool(Role.PREFILL, prefill_urls)
        self.decode = WorkerPool(Role.DECODE, decode_urls)
        self.auth = Authenticator(api_keys)
        self.settings = settings
        self.metrics = RouterMetrics(self)
        self.rooms: set[str] = set()
        self._proxy: httpx.AsyncClient | None = None
        self._probe: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None

    def pools(self) -> tuple[WorkerPool, WorkerPool]:
        return self.prefill, self.decode

    @property
    def proxy(self) -> httpx.AsyncClient:
        assert self._proxy is not None, "router used outside its lifespan"
        return self._proxy

    async def start(self) -> None:
        s = self.settings
        # No keep-alive on the request path: a request never rides a connection the worker has
        # already closed, so "failed before any byte" is exactly a ConnectError, the one failure
        # that is safe to retry on another decode. max_connections=None: streams never queue here.
        self._proxy = httpx.AsyncClient(
            timeout=httpx.Timeout(s.request_timeout, connect=s.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            follow_redirects=False,
        )
        self._probe = httpx.AsyncClient(timeout=httpx.Timeout(s.health_timeout))
        # One round before we listen, so the first request already has a rotation.
        await self.check_all()
        self._health_task = asyncio.create_task(self._health_loop(), name="kvfence-router-health")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        for client in (self._proxy, self._probe):
            if client is not None:
                await client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval)
            await self.check_all()

    async def check_all(self) -> None:
        workers = [w for pool in self.pools() for w in pool.workers]
        await asyncio.gather(*(self._check(w) for w in workers))

    async def _check(self, w: Worker) -> None:
        assert self._probe is not None
        try:
            r = await self._probe.get(w.url + "/health")
            if r.status_code != 200:
                self.mark_down(w, f"/health answered {r.status_code}: {_error_message(r)}")
                return
            r = await self._probe.get(w.url + "/pd/info")
            if r.status_code != 200:
                self.mark_down(w, f"/pd/info answered {r.status_code}: {_error_message(r)}")
                return
            info = r.json()
        except (httpx.HTTPError, ValueError) as e:
            self.mark_down(w, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            return
        problem = _info_problem(w, info)
        if problem is not None:
            self.mark_down(w, problem)
            return
        w.info = info
        w.bootstrap = _bootstrap_address(w, info) if w.role is Role.PREFILL else None
        if not w.healthy:
            logger.info("%s %s is healthy: back in rotation", w.name, w.url)
        w.healthy, w.detail = True, None

    def mark_down(self, w: Worker, detail: str) -> None:
        if w.healthy:
            logger.warning("%s %s out of rotation: %s", w.name, w.url, detail)
        w.healthy, w.detail = False, detail

    def new_room(self) -> str:
        # 128 random bits collide ~never, but a live duplicate would pair two requests' KV.
        while True:
            room = secrets.token_hex(16)
            if room not in self.rooms:
                self.rooms.add(room)
                return room

    def release_room(self, room: str) -> None:
        self.rooms.discard(room)

    def health(self) -> tuple[bool, dict[str, Any]]:
        pairs, refused = 0, []
        for d in self.decode.workers:
            for pf in self.prefill.workers:
                if not (self.decode.usable(d) and self.prefill.usable(pf)):
                    continue
                problem = pairing_error(pf, d)
                if problem is None:
                    pairs += 1
                else:
                    refused.append({"prefill": pf.name, "decode": d.name, "error": problem})
        ok = pairs > 0
        workers = [w.status() for pool in self.pools() for w in pool.workers]
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "workers": workers}
        if refused:
            # I7: a pair that must not exchange KV is never used, and the operator sees why.
            body["pairing_errors"] = refused
        if not ok:
            body.update(_no_workers().body())
        return ok, body


def pairing_error(a: Worker, b: Worker | None) -> str | None:
    """Why a prefill and a decode must not pair (I7), from the facts each reports in /pd/info."""
    if b is None or a.info is None or b.info is None:
        return None
    fa, fb = a.info.get("pairing"), b.info.get("pairing")
    if not isinstance(fa, dict) or not isinstance(fb, dict):
        return None  # a worker that reports no pairing facts pairs at the transfer handshake
    return pairing_problem(fa, fb)


def _error_message(r: httpx.Response) -> str:
    # Workers answer OpenAI-style bodies; their message (e.g. a pairing refusal) is the news.
    try:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
    except ValueError:
        pass
    return r.text[:200]


def _info_problem(w: Worker, info: Any) -> str | None:
    if not isinstance(info, dict):
        return "/pd/info is not a JSON object"
    if info.get("pairing_error"):
        return f"pairing error: {info['pairing_error']}"
    if info.get("role") != w.role.value:
        return f"configured as {w.role.value} but /pd/info says role {info.get('role')!r}"
    if w.role is Role.PREFILL and not isinstance(info.get("bootstrap_port"), int):
        return "prefill reports no bootstrap_port"
    return None


def _bootstrap_address(w: Worker, info: dict[str, Any]) -> str:
    host = info.get("bootstrap_host")
    # A wildcard bind address is not somewhere a decode can dial; the worker's own host is.
    if not host or host in ("0.0.0.0", "::"):
        host = urlsplit(w.url).hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{info['bootstrap_port']}"


def _no_workers() -> APIError:
    return APIError(
        503, "no healthy prefill/decode workers", code="no_workers", type="service_unavailable"
    )


def _unreachable() -> APIError:
    return _upstream_error(502, "Could not connect to a decode worker.", "upstream_unreachable")


def _upstream_error(status: int, message: str, code: str) -> APIError:
    return APIError(status, message, code=code, type=SERVER_ERROR)


def normalize_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"worker URL {url!r} must look like http://HOST:PORT")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"worker URL {url!r} must not have a path, query or fragment")
    return f"{parts.scheme}://{parts.netloc}"


# ---- the relay ---------------------------------------------------------------------------------


class _SSECutter:
    """Passes an event stream on at event boundaries, so a cut upstream never leaves half an event
    in front of our error event, and remembers whether the stream ended the way OpenAI's do."""

    def __init__(self) -> None:
        self._buf = b""
        self.last_data: bytes | None = None

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        cut = 0
        for sep in _SSE_SEPARATORS:
            i = self._buf.rfind(sep)
            if i >= 0:
                cut = max(cut, i + len(sep))
        ready, self._buf = self._buf[:cut], self._buf[cut:]
        if ready:
            self._note(ready)
        return ready

    def _note(self, ready: bytes) -> None:
        text = ready.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        for event in text.split(b"\n\n"):
            lines = event.split(b"\n")
            data = [ln[5:].removeprefix(b" ") for ln in lines if ln.startswith(b"data:")]
            if data:
                self.last_data = b"\n".join(data)

    @property
    def ended_cleanly(self) -> bool:
        """True when the last event was [DONE] or the worker's own error event."""
        if self._buf.strip() or self.last_data is None:
            return False
        if self.last_data.strip() == b"[DONE]":
            return True
        try:
            obj = json.loads(self.last_data)
        except ValueError:
            return False
        return isinstance(obj, dict) and "error" in obj


def _sse_error(err: APIError) -> bytes:
    return b"data: " + json.dumps(err.body(), separators=(",", ":")).encode() + b"\n\n"


def _request_headers(request: Request) -> dict[str, str]:
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
    room: str | None = None
    extra: list[str] = field(default_factory=list)


class _Relay(Response):
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
    ) -> None:
        super().__init__()
        self._state = state
        self._method = method
        self._path = path
        self._route = route or path  # the metric label: bounded, unlike paths with model ids
        self._body = body
        self._headers = headers
        self._paired = paired
        self._p = _Progress()
        self._held: list[Worker] = []

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
                "%s %s status=%d decode=%s prefill=%s room=%s client_gone=%s%s duration_s=%.4f",
                self._method,
                self._path,
                status,
                p.decode.name if p.decode else "-",
                p.prefill.name if p.prefill else "-",
                p.room[:8] + "…" if p.room else "-",  # enough to correlate; the id stays secret
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
                await self._fail(send, _upstream_error(500, "Internal router error.", "internal"))
        if deadline.cancelled_caught:
            p.extra.append("error=timeout")
            msg = f"The request did not finish within {self._state.settings.request_timeout:g} s."
            await self._fail(send, _upstream_error(504, msg, "upstream_timeout"))

    async def _attempts(self, send: Send) -> None:
        st, p = self._state, self._p
        tried: list[Worker] = []
        for attempt in range(2):
            decode = st.decode.pick(exclude=tried)
            prefill = st.prefill.pick(partner=decode) if self._paired and decode else None
            if decode is None or (self._paired and prefill is None):
                await self._send_error(send, _unreachable() if tried else _no_workers())
                return
            p.decode, p.prefill = decode, prefill
            headers = dict(self._headers)
            if prefill is not None:
                p.room = st.new_room()
                headers[HEADER_PREFILL] = prefill.bootstrap or ""
                headers[HEADER_ROOM] = p.room
            self._hold(prefill, decode)
            try:
                if await self._exchange(send, decode, headers):
                    return
                # Nothing reached that decode: safe to send the same request elsewhere, once.
                tried.append(decode)
                if attempt == 0:
                    st.metrics.retries.inc()
                    p.extra.append(f"retried_from={decode.name}")
            finally:
                self._release()
        await self._send_error(send, _unreachable())

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
        if self._p.room is not None:
            self._state.release_room(self._p.room)

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
                _upstream_error(
                    502,
                    f"The decode worker failed before answering ({type(e).__name__}).",
                    "upstream_failed",
                ),
            )
            return True
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
                    _upstream_error(
                        502, "The decode worker failed while answering.", "upstream_failed"
                    ),
                )
                return
            self._release()
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
                _upstream_error(
                    502,
                    "The decode worker stopped before the answer was complete.",
                    "upstream_failed",
                )
            )
        )
        await self._end_stream(send, tail)

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
        await self._whole(send, err.status, [(b"content-type", b"application/json")], body)

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


# ---- the app -----------------------------------------------------------------------------------


def build_router_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    api_keys: dict[str, str] | None,
    health_interval: float = DEFAULT_HEALTH_INTERVAL_S,
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT_S,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The router app. Its lifespan opens the HTTP clients, runs one health round, then polls."""
    prefill = [normalize_url(u) for u in prefill_urls]
    decode = [normalize_url(u) for u in decode_urls]
    if not prefill or not decode:
        raise ValueError("the router needs at least one prefill and one decode worker")
    everyone = prefill + decode
    if len(set(everyone)) != len(everyone):
        raise ValueError("a worker URL is listed twice (each worker has exactly one role)")
    settings = RouterSettings(
        health_interval=health_interval,
        health_timeout=health_timeout,
        request_timeout=request_timeout,
        connect_timeout=connect_timeout,
        max_body_bytes=max_body_bytes,
    )
    state = RouterState(prefill, decode, api_keys, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(
        title="kvfence router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.router = state
    install_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = state.health()
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        data, content_type = state.metrics.render()
        return Response(data, media_type=content_type)

    async def relay_post(request: Request) -> Response:
        # First door: a bad key never costs a worker anything.
        state.auth.tenant_for(request.headers.get("authorization"))
        body = await _read_body(request, settings.max_body_bytes)
        return _Relay(state, "POST", request.url.path, body, _request_headers(request), paired=True)

    async def relay_get(request: Request) -> Response:
        state.auth.tenant_for(request.headers.get("authorization"))
        route = request.scope["route"].path if "route" in request.scope else None
        return _Relay(
            state,
            "GET",
            request.url.path,
            b"",
            _request_headers(request),
            paired=False,
            route=route,
        )

    app.add_api_route("/v1/completions", relay_post, methods=["POST"])
    app.add_api_route("/v1/chat/completions", relay_post, methods=["POST"])
    app.add_api_route("/v1/models", relay_get, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", relay_get, methods=["GET"])
    return app


async def _read_body(request: Request, limit: int) -> bytes:
    chunks: list[bytes] = []
    received = 0
    try:
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise APIError(
                    413,
                    f"Request body is larger than the {limit}-byte limit.",
                    code="request_too_large",
                )
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody will read this; it only keeps a hang-up out of the error log.
        raise APIError(400, "Client disconnected.", code="client_disconnected") from None
    return b"".join(chunks)


# ---- the command -------------------------------------------------------------------------------


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="prefill worker URL(s), e.g. http://127.0.0.1:30001",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        required=True,
        metavar="URL",
        help="decode worker URL(s)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-file", default=None, help="lines of `key tenant`; enables auth")
    p.add_argument(
        "--health-interval",
        type=float,
        default=DEFAULT_HEALTH_INTERVAL_S,
        help="seconds between worker health polls",
    )
    p.add_argument("--health-timeout", type=float, default=DEFAULT_HEALTH_TIMEOUT_S)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a whole request (stream included) may take",
    )
    p.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S)
    p.add_argument("--log-level", default="info")


class _ReadyServer(uvicorn.Server):
    """Prints one ready line once the socket listens (the same contract as `kvfence serve`)."""

    def __init__(self, config: uvicorn.Config, ready: Callable[[int], str]) -> None:
        super().__init__(config)
        self._ready = ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started:
            port = self.config.port
            for server in self.servers:  # the real port when asked for port 0
                for sock in server.sockets:
                    port = sock.getsockname()[1]
            print(self._ready(port), flush=True)


def run_router(args: argparse.Namespace) -> int:
    try:
        api_keys = load_api_keys(args.api_key_file) if args.api_key_file else None
        app = build_router_app(
            args.prefill,
            args.decode,
            api_keys=api_keys,
            health_interval=args.health_interval,
            health_timeout=args.health_timeout,
            request_timeout=args.request_timeout,
            connect_timeout=args.connect_timeout,
        )
    except (ApiKeyFileError, ValueError) as e:
        print(f"kvfence router: {e}", file=sys.stderr)
        return 1
    state: RouterState = app.state.router
    # One line per health poll per worker would drown the request log.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))

    def ready(port: int) -> str:
        return (
            f"kvfence router ready: http://{args.host}:{port} "
            f"({len(args.prefill)} prefill, {len(args.decode)} decode; healthy now "
            f"{state.prefill.healthy_count()} prefill, {state.decode.healthy_count()} decode)"
        )

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        # Closing what is still open after the grace is safe: a closed upstream connection is
        # how a decode learns to abort its transfer with acknowledgement.
        timeout_graceful_shutdown=DEFAULT_GRACEFUL_SHUTDOWN_S,
    )
    server = _ReadyServer(config, ready)
    server.run()
    return 0 if server.started else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfence router", description="OpenAI entry point for prefill/decode workers"
    )
    add_router_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_router(args)


__all__ = [
    "HEADER_PREFILL",
    "HEADER_ROOM",
    "Role",
    "RouterState",
    "Worker",
    "WorkerPool",
    "add_router_args",
    "build_router_app",
    "main",
    "normalize_url",
    "run_router",
]

if __name__ == "__main__":
    sys.exit(main())
