"""In-process PD for fast tests: a 1P1D pair (two engines, real TCP between them), and a
cluster of several prefills and decodes placed by the router's own routing policy."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from tls_certs import files
from waiting import poll

from kvfence.config import EngineConfig, NodeConfig, PdConfig, RoutingConfig, ServerConfig
from kvfence.engine.admission import Rejected
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults
from kvfence.node import build_role
from kvfence.pd.decode import DecodeService
from kvfence.pd.prefill import PrefillService
from kvfence.pd.transport.tcp import LinkLimits
from kvfence.server.router.policy import Pair, Routing
from kvfence.server.router.workers import Role, WorkerPool


def pd_node(
    cfg: EngineConfig,
    role: str,
    timeout_s: float,
    backend: str = "tcp",
    limits: LinkLimits | None = None,
) -> NodeConfig:
    """The NodeConfig of an in-process PD role on this host: the tests' certificates of its
    role, any free bootstrap port (prefill), the limits given."""
    f, lim = files(role), limits or LinkLimits()
    pd = PdConfig(role, 0, backend, timeout_s, lim.handshake_timeout_s,
                  lim.max_pending_handshakes, lim.idle_timeout_s, f.cert, f.key, f.ca)  # fmt: skip
    return NodeConfig(cfg, ServerConfig(host="127.0.0.1"), pd)


def prefill_service(config: NodeConfig, faults: Faults) -> PrefillService:
    svc = build_role(config, faults)
    assert isinstance(svc, PrefillService)
    return svc


def decode_service(config: NodeConfig, faults: Faults) -> DecodeService:
    svc = build_role(config, faults)
    assert isinstance(svc, DecodeService)
    return svc


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    final: RequestOutput | None = None
    done: threading.Event = field(default_factory=threading.Event)


class PDPair:
    """faults: the one object both roles share, as one process would (tests arm points on it)."""

    def __init__(
        self,
        model: str,
        timeout_s: float = 10.0,
        faults: Faults | None = None,
        backend: str = "tcp",
        decode_model: str | None = None,
        decode_kwargs: dict | None = None,
        limits: LinkLimits | None = None,
        **engine_kwargs,
    ) -> None:
        decode_model = decode_model or model
        self.faults = faults if faults is not None else Faults()
        pcfg = EngineConfig(model=model, **engine_kwargs)
        dcfg = EngineConfig(model=decode_model, **{**engine_kwargs, **(decode_kwargs or {})})
        prefill = pd_node(pcfg, "prefill", timeout_s, backend, limits)
        decode = pd_node(dcfg, "decode", timeout_s, backend, limits)
        self.prefill = prefill_service(prefill, self.faults)
        self.decode = decode_service(decode, self.faults)
        self.prefill.start()
        self.decode.start()
        self.peer = f"127.0.0.1:{self.prefill.port}"
        self._n = 0

    def submit(
        self, prompt: list[int], params: SamplingParams, tenant: str = "t", rid: str | None = None
    ) -> tuple[str, Result | Rejected]:
        self._n += 1
        rid = rid or f"{self._n:032x}"
        res = Result()
        verdict = self.decode.submit(
            GenerateRequest(rid, tenant, tuple(prompt), params, self.peer), _sink(res)
        )
        return rid, (verdict if isinstance(verdict, Rejected) else res)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Result]:
        results = []
        for p in prompts:
            _, r = self.submit(p, params)
            assert isinstance(r, Result), r
            results.append(r)
        for r in results:
            assert r.done.wait(60), "request did not finish"
        return results

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Both pools back to zero used pages and nothing in flight."""
        def idle() -> bool:
            return self.pages_used() == (0, 0) and not self.decode.rooms and not self.prefill.rooms

        return poll(idle, timeout, interval=0.05)

    def pages_used(self) -> tuple[int, int]:
        return self.prefill.engine.pool.num_used, self.decode.engine.pool.num_used

    def close(self) -> None:
        self.decode.shutdown()
        self.prefill.shutdown()


def finished_ok(r: Result) -> bool:
    return r.final is not None and r.final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def _sink(res: Result):
    def sink(o: RequestOutput) -> None:
        res.token_ids.extend(o.new_token_ids)
        res.text += o.new_text
        if o.finished:
            res.final = o
            res.done.set()

    return sink


class PDCluster:
    """`n_prefill` prefills and `n_decode` decodes in one process (one Faults object, as PDPair),
    each request placed by the router's `Routing` (its policy and per-tenant prefix index, over
    stand-in worker URLs) exactly as `kvfence router` places it; only the HTTP relay is left out.
    Requests are asked one at a time, so the router's load counts are the open request's."""

    def __init__(
        self,
        model: str,
        n_prefill: int = 2,
        n_decode: int = 2,
        backend: str = "tcp",
        routing: RoutingConfig | None = None,
        timeout_s: float = 10.0,
        **engine_kwargs,
    ) -> None:
        self.faults = Faults()
        cfg = EngineConfig(model=model, **engine_kwargs)
        self.prefills: list[PrefillService] = []
        self.decodes: list[DecodeService] = []
        try:
            for _ in range(n_prefill):
                svc = prefill_service(pd_node(cfg, "prefill", timeout_s, backend), self.faults)
                self.prefills.append(svc)
                svc.start()
            for _ in range(n_decode):
                dsvc = decode_service(pd_node(cfg, "decode", timeout_s, backend), self.faults)
                self.decodes.append(dsvc)
                dsvc.start()
        except BaseException:
            self.close()
            raise
        prefill = WorkerPool(Role.PREFILL, [f"http://prefill-{i}:1" for i in range(n_prefill)])
        decode = WorkerPool(Role.DECODE, [f"http://decode-{i}:1" for i in range(n_decode)])
        for w, svc in zip(prefill.workers, self.prefills, strict=True):
            w.healthy, w.detail, w.bootstrap = True, None, f"127.0.0.1:{svc.port}"
        for w in decode.workers:
            w.healthy, w.detail = True, None
        self.routing = Routing(
            prefill, decode, routing or RoutingConfig(), self.faults, CollectorRegistry()
        )
        self._rid = 0

    @property
    def services(self) -> list[PrefillService | DecodeService]:
        return [*self.prefills, *self.decodes]

    def ask(
        self, prompt: Sequence[int], params: SamplingParams, tenant: str, timeout: float = 60.0
    ) -> tuple[Pair, Result]:
        """Route (as the router would, from the tenant's credential and a completions body of
        token ids), run to the end; returns the router's decisions and the result."""
        body = json.dumps({"prompt": list(prompt), "max_tokens": params.max_tokens}).encode()
        key = self.routing.key(tenant, "/v1/completions", body)
        pair = self.routing.pick_pair(key)
        assert pair is not None, "the router found no pair"
        decode = self.decodes[self.routing.decode.workers.index(pair.decode.worker)]
        prefill = self.prefills[self.routing.prefill.workers.index(pair.prefill.worker)]
        res = Result()
        self._rid += 1
        req = GenerateRequest(f"{self._rid:032x}", tenant, tuple(prompt), params,
                              f"127.0.0.1:{prefill.port}")  # fmt: skip
        pair.decode.worker.in_flight += 1
        pair.prefill.worker.in_flight += 1
        try:
            verdict = decode.submit(req, _sink(res))
            assert not isinstance(verdict, Rejected), verdict
            assert res.done.wait(timeout), "request did not finish"
        finally:
            pair.decode.worker.in_flight -= 1
            pair.prefill.worker.in_flight -= 1
        return pair, res

    def pages_used(self) -> list[int]:
        return [svc.engine.pool.num_used for svc in self.services]

    def wait_idle(self, timeout: float = 10.0) -> bool:
        def idle() -> bool:
            return not any(self.pages_used()) and not any(s.rooms for s in self.services)

        return poll(idle, timeout, interval=0.05)

    def close(self) -> None:
        for svc in (*self.decodes, *self.prefills):
            svc.shutdown()
