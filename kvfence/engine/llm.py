"""LLM: the offline, in-process API (like vLLM's `LLM`): submit prompts, step until all finish."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from kvfence.config import EngineConfig
from kvfence.engine.admission import Rejected
from kvfence.engine.engine import Engine
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults


class RequestRejected(ValueError):
    def __init__(self, rejected: Rejected) -> None:
        self.rejected = rejected
        super().__init__(f"{rejected.code}: {rejected.message}")


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None


class LLM:
    def __init__(self, model: str, faults: Faults | None = None, **engine_kwargs: object) -> None:
        cfg = EngineConfig(model=model, **engine_kwargs)  # type: ignore[arg-type]
        self.engine = Engine(cfg, faults)

    def generate(
        self,
        prompts: list[list[int]] | list[str],
        params: SamplingParams | list[SamplingParams],
        tenant: str = "default",
    ) -> list[Completion]:
        """Run all prompts to completion; raises RequestRejected before running anything if any
        prompt fails admission."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        tok = self.engine.tokenizer
        reqs = [
            GenerateRequest(
                secrets.token_hex(16),
                tenant,
                tuple(p if isinstance(p, list) else tok.encode(p)),
                sp,
            )
            for p, sp in zip(prompts, params_list, strict=True)
        ]
        for r in reqs:
            verdict = self.engine.admit(r)  # the door submit uses, before anything is queued
            if isinstance(verdict, Rejected):
                raise RequestRejected(verdict)
        results = {r.request_id: Completion(r.request_id, list(r.prompt_token_ids)) for r in reqs}

        def sink(out: RequestOutput) -> None:
            c = results[out.request_id]
            c.token_ids.extend(out.new_token_ids)
            c.text += out.new_text
            if out.finish_reason is not None:
                c.finish_reason, c.error = out.finish_reason, out.error

        for r in reqs:
            self.engine.submit(r, sink)
        while any(c.finish_reason is None for c in results.values()):
            self.engine.step()
        return [results[r.request_id] for r in reqs]
