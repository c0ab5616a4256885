"""A tiny deterministic stand-in for a unified role (kvfence.role.RoleService over an Engine), for
testing the HTTP layer only.

It runs the real admission (kvfence.engine.admission.admit), calls sinks from its own thread like
the real engine, and "generates" by echoing the prompt's byte tokens. It records what it was
given (tenant, sampling) and what was aborted, and can be told to hold or fail requests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from kvfence.engine.admission import AdmissionLimits, Admitted, Rejected, admit
from kvfence.engine.engine import EngineStats
from kvfence.engine.request import (
    FinishReason,
    GenerateRequest,
    RequestOutput,
    TokenLogprob,
)

BOS = 256
EOS = 257


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is BOS, 257 is EOS."""

    vocab_size = 258

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if any(m["role"] == "assistant" for m in messages[:1]):
            raise ValueError("conversation must not start with an assistant message")
        text = "<s>" + "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), False)


@dataclass
class _Active:
    req: GenerateRequest
    max_tokens: int
    sink: Callable[[RequestOutput], None]
    source: list[int]
    generated: int = 0
    aborted: bool = False


@dataclass
class FakeEngine:
    model_name: str = "fake-model"
    context_length: int = 512
    pool_tokens: int = 4096
    page_size: int = 16
    step_delay: float = 0.0
    hold: bool = False  # admitted requests produce nothing until aborted
    fail_after: int | None = None  # emit FinishReason.ERROR after this many tokens
    fail_code: str = "kv_grant_mismatch"
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)
    submitted: list[GenerateRequest] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    draining: bool = False

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[str, _Active] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.abort_event = threading.Event()

    # -- the RoleService interface -------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(
        self, req: GenerateRequest, sink: Callable[[RequestOutput], None]
    ) -> Admitted | Rejected:
        limits = AdmissionLimits(self.context_length, self.pool_tokens, self.tokenizer.vocab_size)
        result = (
            Rejected(req.request_id, "draining", "draining", status=503)
            if self.draining
            else admit(req, limits)
        )
        with self._cond:
            if isinstance(result, Rejected):
                self.rejected.append(result)
                return result
            self.submitted.append(req)
            source = [t for t in req.prompt_token_ids if t != BOS] or [ord("x")]
            self._active[req.request_id] = _Active(req, result.max_tokens, sink, source)
            self._cond.notify_all()
        return result

    def stop_admitting(self) -> None:
        self.draining = True  # as Engine.admit: a 503 at the door from now on

    def abort(self, request_id: str) -> None:
        with self._cond:
            self.aborted.append(request_id)
            a = self._active.get(request_id)
            if a is not None:
                a.aborted = True
            self._cond.notify_all()
        self.abort_event.set()

    def info(self) -> dict[str, Any]:
        return {
            "role": "unified",
            "bootstrap_host": None,
            "bootstrap_port": None,
            "model": self.model_name,
            "context_length": self.context_length,
        }

    def metrics(self) -> Iterable[Metric]:
        return ()

    def stats(self) -> EngineStats:
        with self._cond:
            used = sum(
                -(-(len(a.req.prompt_token_ids) + a.generated) // self.page_size)
                for a in self._active.values()
            )
            running = len(self._active)
        total = self.pool_tokens // self.page_size
        return EngineStats(
            pages_total=total, pages_used=used, pages_free=total - used, page_size=self.page_size,
            pool_tokens=self.pool_tokens, running=running, waiting=0, preemptions=0,
        )

    # -- the loop ------------------------------------------------------------------------------

    def _runnable(self) -> bool:
        return any(a.aborted or not self.hold for a in self._active.values())

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._runnable():
                    self._cond.wait(timeout=0.1)
                if self._stop:
                    return
                batch = [a for a in self._active.values() if a.aborted or not self.hold]
            emitted = [(a, self._step(a)) for a in batch]
            with self._cond:
                for a, out in emitted:
                    if out.finished:
                        self._active.pop(a.req.request_id, None)
            for a, out in emitted:
                a.sink(out)
            if self.step_delay:
                time.sleep(self.step_delay)

    def _step(self, a: _Active) -> RequestOutput:
        prompt_tokens = len(a.req.prompt_token_ids)
        if a.aborted:
            return RequestOutput(a.req.request_id, (), "", FinishReason.ABORT, prompt_tokens,
                                 a.generated)
        if self.fail_after is not None and a.generated >= self.fail_after:
            return RequestOutput(
                a.req.request_id, (), "", FinishReason.ERROR, prompt_tokens, a.generated,
                error="KV grant check failed for this request.", error_code=self.fail_code,
            )
        token = a.source[a.generated % len(a.source)]
        a.generated += 1
        finish: FinishReason | None = None
        if token == EOS and not a.req.sampling.ignore_eos:
            finish = FinishReason.STOP
        elif token in a.req.sampling.stop_token_ids:
            finish = FinishReason.STOP
        elif a.generated >= a.max_tokens:
            finish = FinishReason.LENGTH
        lps: tuple[TokenLogprob, ...] = ()
        k = a.req.sampling.logprobs
        if k is not None:
            top = tuple((t % 256, -0.5 - i) for i, t in enumerate(range(token, token + k)))
            lps = (TokenLogprob(token, -0.5, top),)
        text = self.tokenizer.decode([token])
        return RequestOutput(a.req.request_id, (token,), text, finish, prompt_tokens, a.generated,
                             lps)
