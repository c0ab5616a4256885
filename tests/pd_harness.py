"""An in-process 1P1D pair (two engines, real TCP between them) for fast PD tests."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from tls_certs import tls
from waiting import poll

from kvfence.config import EngineConfig
from kvfence.engine.admission import Rejected
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults
from kvfence.pd.decode import DecodeService
from kvfence.pd.prefill import PrefillService
from kvfence.pd.transport.tcp import LinkLimits


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
        self.prefill = PrefillService(
            pcfg, "127.0.0.1", 0, timeout_s, backend, tls("prefill"), self.faults, limits
        )
        self.decode = DecodeService(
            dcfg, timeout_s, backend, tls("decode"), self.faults, limits=limits
        )
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

        def sink(o: RequestOutput) -> None:
            res.token_ids.extend(o.new_token_ids)
            res.text += o.new_text
            if o.finished:
                res.final = o
                res.done.set()

        verdict = self.decode.submit(
            GenerateRequest(rid, tenant, tuple(prompt), params, self.peer), sink
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
