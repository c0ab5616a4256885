"""Admission (I1): the only door into the pool. `admit` returns Admitted or Rejected, nothing else.

Only an Admitted may become a Sequence and ask the pool for pages, so a rejected request can
never be swapped for a placeholder: there is no value to swap it into.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.engine.prompt_logprobs import MAX_PROMPT_LOGPROB_ENTRIES, prompt_entries
from kvfence.engine.request import GenerateRequest
from kvfence.guards import ALL_ON, Guards

# The engine serves nothing more (a tensor-parallel rank or the engine process was lost): a 503.
ENGINE_FAILED = "engine_failed"


@dataclass(frozen=True)
class Admitted:
    request: GenerateRequest
    max_tokens: int  # resolved: the request's own, or context_length - prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)


@dataclass(frozen=True)
class Rejected:
    request_id: str
    code: str  # stable machine-readable reason, also the metrics label
    message: str
    param: str | None = None
    status: int = 400  # the HTTP status its client gets (503: the node is draining)


@dataclass(frozen=True)
class AdmissionLimits:
    context_length: int
    pool_tokens: int
    vocab_size: int


def admit(
    req: GenerateRequest, limits: AdmissionLimits, guards: Guards = ALL_ON
) -> Admitted | Rejected:
    n = len(req.prompt_token_ids)
    if not guards.on("admission"):
        return Admitted(req, req.sampling.max_tokens or 1)
    if n == 0:
        return Rejected(req.request_id, "empty_prompt", "The prompt is empty.", "prompt")
    bad = [t for t in req.prompt_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        return Rejected(
            req.request_id,
            "invalid_token_id",
            f"Token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size}).",
            "prompt",
        )
    if n >= limits.context_length:
        return Rejected(
            req.request_id,
            "context_length_exceeded",
            f"This model's maximum context length is {limits.context_length} tokens. "
            f"However, your prompt has {n} tokens, leaving no room for a completion.",
            "prompt",
        )
    if n > limits.pool_tokens:
        return Rejected(
            req.request_id,
            "exceeds_kv_pool",
            f"The prompt has {n} tokens but this node's KV pool holds {limits.pool_tokens}.",
            "prompt",
        )
    k = req.sampling.prompt_logprobs
    if k is not None and prompt_entries(n, k) > MAX_PROMPT_LOGPROB_ENTRIES:
        return Rejected(
            req.request_id,
            "prompt_logprobs_too_large",
            f"Prompt logprobs for {n} prompt tokens with the top {k} are "
            f"{prompt_entries(n, k)} entries; at most {MAX_PROMPT_LOGPROB_ENTRIES} are served "
            "per request (send a shorter prompt or a smaller k).",
            "prompt_logprobs",
        )
    max_tokens = req.sampling.max_tokens
    if max_tokens is None:
        max_tokens = limits.context_length - n
    elif n + max_tokens > limits.context_length:
        return Rejected(
            req.request_id,
            "context_length_exceeded",
            f"This model's maximum context length is {limits.context_length} tokens. "
            f"However, you requested {n + max_tokens} tokens ({n} in the prompt, "
            f"{max_tokens} for the completion).",
            "max_tokens",
        )
    if n + max_tokens > limits.pool_tokens:
        return Rejected(
            req.request_id,
            "exceeds_kv_pool",
            f"The request needs {n + max_tokens} KV tokens but this node's pool holds "
            f"{limits.pool_tokens}.",
            "max_tokens",
        )
    return Admitted(req, max_tokens)
