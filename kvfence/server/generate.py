"""One parsed request's run through the engine to its HTTP answer: a JSON body when collected, an
SSE stream otherwise. A failure before the first token is an error status; after it, an error
event and never [DONE] (I5)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvfence import sse
from kvfence.engine.admission import Rejected
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.server.app_state import AppState, Event, Generation
from kvfence.server.drain import NOT_ADMITTED_HEADER
from kvfence.server.errors import APIError, server_failure
from kvfence.server.metrics import RequestRecord
from kvfence.server.schemas import AnswerFormat, ChoiceState, Delta, usage

if TYPE_CHECKING:
    from kvfence.lora.checkpoint import LoraAdapter

_FAILED = (FinishReason.ERROR, FinishReason.ABORT)


def record(request: Request) -> RequestRecord:
    """This request's metrics record (set by RequestRecorder), or a loose one outside it."""
    rec = request.scope.get("kvfence.record")
    return rec if rec is not None else RequestRecord()


class _Progress:
    """Accumulates outputs per choice and feeds the latency/finish metrics as they arrive."""

    def __init__(
        self, state: AppState, rec: RequestRecord, n_choices: int, prompt_tokens: int, n: int
    ):
        self.metrics = state.metrics
        self.rec = rec
        self.choices = [ChoiceState(i) for i in range(n_choices)]
        self.prompt_tokens = prompt_tokens
        # A prompt counts once however many choices it has (as prompt_tokens does): its first
        # choice's reuse is the prompt's. Reported only where the engine has a prefix cache.
        self.n = n
        self.reports_cache = bool(getattr(state.engine, "prefix_caching", False))
        self.cached = [0] * n_choices
        self._first_token_at: float | None = None
        self._last_at: list[float | None] = [None] * n_choices

    def apply(self, index: int, out: RequestOutput) -> ChoiceState:
        now = time.monotonic()
        c = self.choices[index]
        if out.new_token_ids:
            if self._first_token_at is None:
                self._first_token_at = now
                self.metrics.ttft.observe(now - self.rec.start)
            last = self._last_at[index]
            if last is not None:
                self.metrics.itl.observe(now - last)
            self._last_at[index] = now
        c.text.append(out.new_text)
        c.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        c.text_offset += len(out.new_text)
        c.completion_tokens = out.completion_tokens  # cumulative per the engine contract
        self.cached[index] = out.cached_tokens
        self.rec.completion_tokens = sum(x.completion_tokens for x in self.choices)
        if out.finish_reason is not None:
            c.finish_reason = out.finish_reason.value
            self.rec.finish = out.finish_reason.value
            self.metrics.finishes.labels(reason=out.finish_reason.value).inc()
            if all(x.finish_reason is not None for x in self.choices):
                self.metrics.e2e.observe(now - self.rec.start)
        return c

    def usage(self) -> dict[str, Any]:
        cached = sum(self.cached[:: self.n]) if self.reports_cache else None
        return usage(self.prompt_tokens, self.rec.completion_tokens, cached)


def _engine_failure(out: RequestOutput) -> APIError:
    # I5: the client sees the engine's reason, never a 200 with what was produced so far.
    if out.finish_reason is FinishReason.ERROR:
        # A 4xx from another door (e.g. prefill's admission in PD mode) stays the client's.
        return server_failure(
            out.error_code or "internal_error",
            out.error or "The engine failed this request.",
            out.error_status,
        )
    return server_failure(
        "request_aborted", "The request was aborted by the server before it finished.", None
    )


async def generate(
    state: AppState,
    request: Request,
    tenant: str,
    fmt: AnswerFormat,
    ids: list[str],
    prompts: list[list[int]],
    sampling: SamplingParams,
    n: int,
    stream: bool,
    include_usage: bool,
    cache_salt: str | None = None,
    lora: LoraAdapter | None = None,
) -> Response:
    rec = record(request)
    rec.request_id = ids[0]
    rec.n_generations = len(ids)
    # Before anything is admitted: a decode dials only the prefill its router signed for.
    peer = state.hop.prefill(request.headers)
    # Choice index = prompt index * n + j, as OpenAI numbers them.
    reqs = [
        GenerateRequest(
            request_id=ids[p * n + j],
            tenant=tenant,
            prompt_token_ids=tuple(prompt),
            sampling=sampling,
            peer=peer,  # set by the router in PD mode; only a decode worker reads it
            cache_salt=cache_salt,
            lora=lora,  # resolved for this tenant by the model check
        )
        for p, prompt in enumerate(prompts)
        for j in range(n)
    ]
    gen = Generation(
        state.engine, reqs, state.faults, on_close=state.drain.untrack, outbox=state.outbox
    )
    state.drain.track(gen)
    handed_off = False
    try:
        rejected = await gen.submit()
        if rejected is not None:
            raise _rejection(rejected)
        progress = _Progress(state, rec, len(reqs), sum(len(p) for p in prompts), n)
        rec.prompt_tokens = progress.prompt_tokens
        gen.watch_disconnect(request.receive)
        if not stream:
            return await _collect(gen, fmt, progress)
        first = await _until_first_token(gen, progress)
        if first is None:
            return _client_gone(rec)
        handed_off = True
        return _SSEResponse(gen, _sse_chunks(gen, fmt, progress, first, include_usage))
    finally:
        if not handed_off:
            gen.close()


def _rejection(rejected: Rejected) -> APIError:
    if rejected.status < 500:
        return APIError(
            rejected.status, rejected.message, code=rejected.code, param=rejected.param
        )
    # A draining node: this request reached no engine, so the router may send it elsewhere.
    err = server_failure(rejected.code, rejected.message, rejected.status)
    err.headers = {**(err.headers or {}), NOT_ADMITTED_HEADER: rejected.code}
    return err


def _client_gone(rec: RequestRecord) -> Response:
    rec.finish = "client_gone"
    return Response(status_code=499)  # nginx's "client closed request": nobody reads it


async def _collect(gen: Generation, fmt: AnswerFormat, progress: _Progress) -> Response:
    while not gen.all_finished:
        event = await gen.next_event()
        if event is None:
            return _client_gone(progress.rec)
        index, out = event
        progress.apply(index, _shown(fmt, out))
        if out.finish_reason in _FAILED:
            raise _engine_failure(out)
    return JSONResponse(fmt.body(progress.choices, progress.usage()))


def _shown(fmt: AnswerFormat, out: RequestOutput) -> RequestOutput:
    ask = getattr(fmt, "ask", None)  # a Responses answer asks nothing of its prompt
    return ask.shown(out) if ask is not None else out


async def _until_first_token(gen: Generation, progress: _Progress) -> list[Event] | None:
    """Hold the status line until something real arrives, so a failure before the first token is
    still an HTTP error status rather than an error buried in a 200 stream."""
    events: list[Event] = []
    while True:
        event = await gen.next_event()
        if event is None:
            return None
        events.append(event)
        _, out = event
        if out.finish_reason in _FAILED:
            progress.apply(*event)
            raise _engine_failure(out)
        if out.new_token_ids or out.new_text or out.finished:
            return events


def _sse(fmt: AnswerFormat, obj: dict[str, Any], include_usage: bool) -> bytes:
    if include_usage and "usage" not in obj:
        obj["usage"] = None
    return fmt.encode(obj)


async def _sse_chunks(
    gen: Generation,
    fmt: AnswerFormat,
    progress: _Progress,
    first: list[Event],
    include_usage: bool,
) -> AsyncGenerator[bytes, None]:
    for chunk in fmt.start_chunks(len(gen.requests)):
        yield _sse(fmt, chunk, include_usage)
    pending = deque(first)
    while pending or not gen.all_finished:
        event = pending.popleft() if pending else await gen.next_event()
        if event is None:
            progress.rec.finish = "client_gone"
            return
        index, out = event
        out = _shown(fmt, out)
        offset = progress.choices[index].text_offset
        choice = progress.apply(index, out)
        if out.finish_reason in _FAILED:
            # Headers are gone: an error event, then silence. Never [DONE] after partial text.
            err = _engine_failure(out)
            progress.rec.error_code = err.code
            yield sse.encode(err.body())
            return
        finish = out.finish_reason.value if out.finish_reason is not None else None
        delta = Delta(out.new_text, out.logprobs, offset, finish, len(out.new_token_ids))
        chunks = fmt.delta_chunks(choice, delta)
        for chunk in chunks:
            yield _sse(fmt, chunk, include_usage)
    for chunk in fmt.end_chunks(progress.usage(), include_usage):
        yield _sse(fmt, chunk, include_usage)
    if fmt.end_of_stream:
        yield fmt.end_of_stream


class _SSEResponse(StreamingResponse):
    """Streams a Generation. Whatever ends the stream (done, error, hang-up, server shutdown),
    the finally aborts what is unfinished: this response owns the Generation once returned."""

    def __init__(self, gen: Generation, chunks: AsyncGenerator[bytes, None]) -> None:
        super().__init__(
            chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._gen = gen
        self._chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            async for chunk in self._chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # ASGI 2.4 servers raise on send to a closed connection
            pass
        finally:
            self._gen.close()
            await self._chunks.aclose()


__all__ = ["generate", "record"]
