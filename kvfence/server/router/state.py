"""The router's shared state: its worker pools, auth, metrics and HTTP clients, and the health
poll that keeps each worker in or out of rotation (and says why in /health)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvfence.faults import Faults
from kvfence.server.auth import Authenticator
from kvfence.server.errors import APIError, server_failure
from kvfence.server.operator import OperatorGate, operator_headers
from kvfence.server.router.args import RouterSettings
from kvfence.server.router.metrics import RouterMetrics
from kvfence.server.router.policy import Routing
from kvfence.server.router.workers import Role, Worker, WorkerPool, pairing_error

logger = logging.getLogger("kvfence.router")


class RouterState:
    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        api_keys: dict[str, str] | None,
        settings: RouterSettings,
        faults: Faults | None = None,
        operator_key: str | None = None,
    ) -> None:
        self.operator_key = operator_key
        # The worker endpoints the health poll reads are the operator's; so is our detail.
        self.operator = OperatorGate(operator_key, api_keys is not None)
        self._probe_headers = operator_headers(operator_key) if operator_key else {}
        self.prefill = WorkerPool(Role.PREFILL, prefill_urls)
        self.decode = WorkerPool(Role.DECODE, decode_urls)
        self.auth = Authenticator(api_keys)
        self.settings = settings
        self.metrics = RouterMetrics(self.pools)
        self.routing = Routing(
            self.prefill,
            self.decode,
            settings.routing,
            faults or Faults(),
            self.metrics.registry,
            settings.shared_prefixes,
        )
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
        self._probe = httpx.AsyncClient(
            timeout=httpx.Timeout(s.health_timeout), headers=self._probe_headers
        )
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
        if restarted(w, info):
            dropped = self.routing.index.forget(w.url)
            logger.info("%s %s restarted: its prefix predictions dropped (%d chunks)",
                        w.name, w.url, dropped)  # fmt: skip
        w.info = info
        w.bootstrap = _bootstrap_address(w, info) if w.role is Role.PREFILL else None
        if not w.healthy:
            logger.info("%s %s is healthy: back in rotation", w.name, w.url)
        w.healthy, w.detail = True, None

    def mark_down(self, w: Worker, detail: str) -> None:
        if w.healthy:
            logger.warning("%s %s out of rotation: %s", w.name, w.url, detail)
        w.healthy, w.detail = False, detail

    def public_health(self) -> tuple[bool, dict[str, Any]]:
        """What anyone may read: up or down, nothing about the workers."""
        ok, _ = self.health()
        return ok, {"status": "ok" if ok else "unavailable"}

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
            body.update(no_workers().body())
        return ok, body


def restarted(w: Worker, info: dict[str, Any]) -> bool:
    """Whether the worker's process is not the one the router last saw (its /pd/info instance
    changed), so its prefix cache is empty; a worker that reports no instance counts as
    restarted whenever it comes back from out of rotation."""
    instance = info.get("instance")
    if w.info is None:
        return False  # first sight: nothing was predicted there yet
    if instance is None:
        return not w.healthy
    return instance != w.info.get("instance")


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


def no_workers() -> APIError:
    return server_failure("no_workers", "no healthy prefill/decode workers", 503)
