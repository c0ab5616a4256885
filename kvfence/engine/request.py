"""Request-side value types: sampling parameters, what a caller submits, what the engine emits."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvfence.structured.spec import Constraint

if TYPE_CHECKING:  # the HTTP layer imports this module; torch loads with the engine
    from kvfence.lora.checkpoint import LoraAdapter

_TUPLES = ("stop", "stop_token_ids")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: context_length - prompt_len (decided at admission)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    # vLLM's prompt_logprobs: each prompt token's logprob (from the second on) plus the top k,
    # computed in prefill; None: off.
    prompt_logprobs: int | None = None
    # Structured output: the grammar every sampled token must keep the answer inside (None: free).
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise ValueError("prompt_logprobs must be in [0, 20]")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise TypeError("constraint must be a Constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-able (tuples as lists): how a RESERVE carries them to prefill."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key in _TUPLES:
            out[key] = list(out[key])
        if self.constraint is not None:
            out["constraint"] = self.constraint.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """The inverse of to_dict, validated like any construction: an unknown field raises
        TypeError, a bad value ValueError."""
        if not isinstance(data, Mapping):
            raise TypeError(f"sampling must be an object, not {type(data).__name__}")
        kw = dict(data)
        for key in _TUPLES:
            if key in kw:
                value = kw[key]
                if not isinstance(value, (list, tuple)):
                    raise TypeError(f"{key} must be a list")
                kw[key] = tuple(value)
        if kw.get("constraint") is not None:
            kw["constraint"] = Constraint.from_dict(kw["constraint"])
        return cls(**kw)


@dataclass(frozen=True)
class GenerateRequest:
    """One generation as the HTTP layer hands it to the engine. tenant comes from the credential."""

    request_id: str
    tenant: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    peer: str | None = None  # PD decode: the prefill bootstrap address the router picked
    # vLLM's request field: a sub-namespace of the prefix cache *inside* tenant (narrows only).
    cache_salt: str | None = None
    # The LoRA adapter the model field named, resolved for this tenant (None: the base model).
    # The object, not its name: an unload or a reload under the same name never changes it.
    lora: LoraAdapter | None = None


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # client went away or operator aborted
    ERROR = "error"  # the engine failed this request closed; see RequestOutput.error


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """Each prompt token from the second on (the first has no context to be scored in): its
    logprob, its rank in the vocabulary (1: the most likely) and the top k (ids, logprobs)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able lists: how DONE carries them from prefill to decode."""
        return {f.name: [list(x) if isinstance(x, tuple) else x for x in getattr(self, f.name)]
                for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptLogprobs:
        """The inverse of to_dict; a malformed value raises ValueError or TypeError."""
        if not isinstance(data, Mapping) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError("prompt logprobs: unexpected fields")
        out = cls(
            tuple(int(x) for x in data["token_ids"]),
            tuple(float(x) for x in data["logprobs"]),
            tuple(int(x) for x in data["ranks"]),
            tuple(tuple(int(t) for t in row) for row in data["top_ids"]),
            tuple(tuple(float(v) for v in row) for row in data["top_logprobs"]),
        )
        n = len(out.token_ids)
        lengths = {len(out.logprobs), len(out.ranks), len(out.top_ids), len(out.top_logprobs)}
        if lengths != {n} or any(
            len(i) != len(v) for i, v in zip(out.top_ids, out.top_logprobs, strict=True)
        ):
            raise ValueError("prompt logprobs: fields of different lengths")
        return out


@dataclass(frozen=True)
class RequestOutput:
    """An increment of one request's answer; the last one has finish_reason set."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None  # set with FinishReason.ERROR: the reason the client sees
    error_code: str | None = None
    error_status: int | None = None  # HTTP status for the error; None: 500
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # on the first output, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
