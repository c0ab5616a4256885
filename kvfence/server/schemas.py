"""Wire shapes of the OpenAI API: validated request models and the response/chunk builders."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfence import sse
from kvfence.engine.request import PromptLogprobs, SamplingParams, TokenLogprob
from kvfence.server.errors import bad_request
from kvfence.server.prompt_echo import (
    PromptAsk,
    check_prompt_fields,
    legacy_logprobs,
    sampled_entries,
    vllm_prompt_logprobs,
)
from kvfence.server.structured import LEGACY_FIELDS, constraint_of
from kvfence.structured.spec import Constraint

MAX_N = 16  # choices per prompt; more is an amplification lever, not a use case
MAX_CHOICES = 64  # prompts x n in one HTTP request
MAX_STOP = 4
MAX_COMPLETION_LOGPROBS = 5
MAX_CHAT_TOP_LOGPROBS = 20
MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs; its -1 (the whole vocabulary) is refused
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default

TokenIds = list[int]
Prompt = str | TokenIds


class _Strict(BaseModel):
    # strict: "5" is not 5 and true is not 1; floats still accept JSON integers.
    # extra="ignore": OpenAI clients send fields we do not know; the body `tenant` is one (I6).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingFields(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool | None = False
    # vLLM's extension: logprobs name tokens "token_id:<n>", so clients can compare ids exactly.
    return_tokens_as_token_ids: bool | None = False
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    best_of: int | None = None
    # vLLM's field: narrows prefix-cache sharing to requests of this tenant with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # Structured outputs: OpenAI's field and vLLM's (server/structured.py reads them).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None  # vLLM's removed spellings: named here only to refuse them
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences are allowed, got {len(items)}")
        if any(s == "" for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Fields we parse but do not implement: refuse rather than silently answer differently."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise _unsupported(name, f"{name} is not supported by this server (send 0 or omit)")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported by this server")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            raise _unsupported("best_of", "best_of is not supported by this server (use n)")

    def constraint(self) -> Constraint | None:
        """The structured output asked for (None: free text); a 400 for a malformed ask."""
        legacy = {k: getattr(self, k) for k in LEGACY_FIELDS}
        return constraint_of(self.response_format, self.structured_outputs, legacy)

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        constraint: Constraint | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=-1 if self.top_k is None else self.top_k,
                seed=self.seed,
                stop=self.stop_list,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos),
                logprobs=logprobs,
                constraint=constraint,
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:  # the engine's own last word on sampling values
            raise bad_request(str(e)) from e


def _unsupported(param: str, message: str) -> Exception:
    return bad_request(message, code="unsupported_parameter", param=param)


def _is_token_id(x: object) -> bool:
    return type(x) is int  # bool is an int subclass; true is not a token id


def _normalize_prompt(v: object) -> list[Prompt]:
    shape = (
        "must be a string, a list of token ids (integers), a list of strings, "
        "or a list of token-id lists"
    )
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list):
        raise ValueError(shape)
    if not v or all(_is_token_id(x) for x in v):
        return [list(v)]
    if all(isinstance(x, str) for x in v):
        return list(v)
    if all(isinstance(x, list) for x in v):
        for i, ids in enumerate(v):
            if not all(_is_token_id(t) for t in ids):
                raise ValueError(f"element {i} must contain only integer token ids")
        return [list(ids) for ids in v]
    if any(_is_token_id(x) for x in v):
        raise ValueError("token ids must all be integers")
    raise ValueError(shape)


class CompletionRequest(_SamplingFields):
    prompt: Any  # normalized to list[Prompt] by the validator below
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt alone
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[Prompt]:
        return _normalize_prompt(v)

    @property
    def prompts(self) -> list[Prompt]:
        return self.prompt  # type: ignore[no-any-return]

    def check_supported(self) -> None:
        super().check_supported()
        check_prompt_fields(
            bool(self.echo), self.max_tokens, self.prompt_logprobs, bool(self.stream)
        )
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported by this server")


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: the call it answers

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: Any) -> str:
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list):
            parts = []
            for i, part in enumerate(v):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ValueError(f"content[{i}]: only text content parts are supported")
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"content[{i}].text must be a string")
                parts.append(text)
            return "".join(parts)
        raise ValueError("content must be a string or a list of text parts")

    @field_validator("tool_calls")
    @classmethod
    def _check_tool_calls(cls, v: list[Any] | None) -> list[Any] | None:
        for i, call in enumerate(v or []):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(f"tool_calls[{i}] must carry function.name")
            if not isinstance(fn.get("arguments", ""), str | dict):
                raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string")
        return v

    def template_dict(self) -> dict[str, Any]:
        # Templates know system/user/assistant; "developer" is OpenAI's newer name for system.
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.content}
        if self.tool_calls:
            # As transformers and vLLM hand them to templates: arguments as an object.
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass  # the template renders the text as the client sent it
    return {**call, "function": fn}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)

    def check_supported(self) -> None:
        super().check_supported()
        check_prompt_fields(False, None, self.prompt_logprobs, bool(self.stream))
        if self.functions:
            raise _unsupported("functions", "functions are not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses -------------------------------------------------------------------------------

TokenText = Callable[[int], str]


@dataclass
class ChoiceState:
    """What one choice has produced so far (for the non-stream body and streaming offsets)."""

    index: int
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # from the first output, when asked for
    echoed: bool = False  # a stream has sent the echoed prompt


@dataclass(frozen=True)
class Delta:
    """What one engine output adds to a choice's stream: its new text and those tokens'
    logprobs, the choice's text offset before them, its finish reason (None until the last),
    and how many tokens it carries (their text may be held back)."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    offset: int
    finish: str | None
    new_tokens: int = 0


class AnswerFormat(Protocol):
    """What generate() drives to write a route's answers: the collected body, and a stream's
    events from its first to its last line."""

    end_of_stream: bytes

    def encode(self, obj: dict[str, Any]) -> bytes: ...

    def body(self, choices: list[ChoiceState], use: dict[str, Any]) -> dict[str, Any]: ...

    def start_chunks(self, n_choices: int) -> list[dict[str, Any]]: ...

    def delta_chunks(self, c: ChoiceState, d: Delta) -> list[dict[str, Any]]: ...

    def end_chunks(self, use: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]: ...


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details.cached_tokens where the server caches prefixes.
    The count is this request's own reuse, within its tenant (or declared public prefixes)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def completion_logprobs(
    lps: list[TokenLogprob] | tuple[TokenLogprob, ...], token_text: TokenText, offset: int
) -> dict[str, Any]:
    return legacy_logprobs(sampled_entries(lps), token_text, offset)


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    s = token_text(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(
    lps: list[TokenLogprob] | tuple[TokenLogprob, ...], token_text: TokenText
) -> dict[str, Any]:
    content = []
    for lp in lps:
        entry = _chat_token(lp.token_id, lp.logprob, token_text)
        entry["top_logprobs"] = [_chat_token(t, v, token_text) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


class CompletionFormat:
    """Shapes `text_completion` bodies and chunks."""

    ask: PromptAsk | None = None  # what the request asked of its prompt (echo, prompt_logprobs)

    def __init__(self, response_id: str, model: str, logprobs: bool, token_text: TokenText):
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.token_text = token_text

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def body(self, choices: list[ChoiceState], use: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope([self._choice(c, "".join(c.text), c.logprobs, 0) for c in choices])
        out["usage"] = use
        return out

    def _choice(
        self, c: ChoiceState, text: str, lps: Sequence[TokenLogprob], offset: int,
        finish: str | None = None, echo: bool = True,
    ) -> dict[str, Any]:
        """One choice (a body's, or a chunk's with `offset` into the choice's text so far); an
        echoing request's first one leads with its prompt."""
        ask = self.ask
        entries = sampled_entries(lps)
        if ask is not None and ask.texts is not None:
            if echo:
                text = ask.echo_text(c.index) + text
                entries = ask.prompt_entries(c.index, c.prompt_logprobs) + entries
            else:
                offset += len(ask.echo_text(c.index))
        choice: dict[str, Any] = {
            "index": c.index,
            "text": text,
            "logprobs": legacy_logprobs(entries, self.token_text, offset)
            if self.logprobs
            else None,
            "finish_reason": finish if finish is not None else c.finish_reason,
        }
        if ask is not None and ask.field_k is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                c.prompt_logprobs, ask.field_k, self.token_text
            )
        return choice

    def start_chunks(self, n_choices: int) -> list[dict[str, Any]]:
        return []

    def delta_chunks(self, c: ChoiceState, d: Delta) -> list[dict[str, Any]]:
        # A chunk per output that carries tokens, even when the detokenizer holds their text back
        # (a partial UTF-8 character, U+FFFD, a possible stop string): vLLM does the same, and
        # clients time TTFT and ITL by chunks.
        echo = self.ask is not None and self.ask.texts is not None and not c.echoed
        if not d.text and not d.logprobs and not d.new_tokens and d.finish is None and not echo:
            return []
        c.echoed = True
        return [self._envelope([self._choice(c, d.text, d.logprobs, d.offset, d.finish, echo)])]

    def usage_chunk(self, use: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope([])
        out["usage"] = use
        return out

    # How a stream's events are written and how it ends (OpenAI's sentinel after the chunks).
    end_of_stream = b"data: [DONE]\n\n"

    def encode(self, obj: dict[str, Any]) -> bytes:
        return sse.encode(obj)

    def end_chunks(self, use: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
        return [self.usage_chunk(use)] if include_usage else []


class ChatFormat(CompletionFormat):
    """Shapes `chat.completion` bodies and `chat.completion.chunk` chunks."""

    def _envelope(self, choices: list[dict[str, Any]], obj: str = "chat.completion.chunk"):
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def body(self, choices: list[ChoiceState], use: dict[str, Any]) -> dict[str, Any]:
        out = self._envelope(
            [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": "".join(c.text)},
                    "logprobs": chat_logprobs(c.logprobs, self.token_text)
                    if self.logprobs
                    else None,
                    "finish_reason": c.finish_reason,
                }
                for c in choices
            ],
            obj="chat.completion",
        )
        if self.ask is not None and self.ask.field_k is not None:
            # vLLM's chat answer: one prompt, so one list beside the choices
            plp = choices[0].prompt_logprobs if choices else None
            out["prompt_logprobs"] = vllm_prompt_logprobs(plp, self.ask.field_k, self.token_text)
        out["usage"] = use
        return out

    def delta_chunk(
        self,
        index: int,
        delta: dict[str, Any],
        logprobs: dict[str, Any] | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """One choice's delta as a chunk: the shape of every chunk of a chat stream (tool-call
        deltas included)."""
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope([choice])

    def start_chunks(self, n_choices: int) -> list[dict[str, Any]]:
        return [self.delta_chunk(i, {"role": "assistant", "content": ""}) for i in range(n_choices)]

    def delta_chunks(self, c: ChoiceState, d: Delta) -> list[dict[str, Any]]:
        out = []
        if d.text or d.logprobs or d.new_tokens:  # `content: ""` for tokens held back
            logprobs = chat_logprobs(d.logprobs, self.token_text) if self.logprobs else None
            out.append(self.delta_chunk(c.index, {"content": d.text}, logprobs))
        if d.finish is not None:
            out.append(self.delta_chunk(c.index, {}, finish=d.finish))
        return out
