"""What a request asks of its own prompt in the answer: `echo` on completions (the prompt's text
first; with `logprobs`, its tokens' entries first, the first token's null, as OpenAI's legacy API
and vLLM answer), `max_tokens: 0` with echo (the prompt alone), and vLLM's `prompt_logprobs`
field (per choice on completions, top-level on chat; refused in streams, as vLLM does)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvfence.engine.request import FinishReason, PromptLogprobs, RequestOutput, TokenLogprob
from kvfence.server.errors import bad_request

TokenText = Callable[[int], str]
# OpenAI's and vLLM's stand-in for -inf: JSON has no infinity.
LOGPROB_FLOOR = -9999.0
# (token id, its logprob or None, the top (id, logprob) pairs or None): one legacy entry.
Entry = tuple[int, float | None, Sequence[tuple[int, float]] | None]


@dataclass(frozen=True)
class PromptAsk:
    prompt_ids: list[list[int]]  # by prompt index
    n: int  # choices per prompt: choice i answers prompt i // n
    texts: list[str] | None = None  # echo: each prompt's text
    echo_logprobs: int | None = None  # echo with logprobs=k: the prompt's entries lead
    field_k: int | None = None  # vLLM's prompt_logprobs=k
    prompt_only: bool = False  # max_tokens 0: nothing generated is shown

    def shown(self, out: RequestOutput) -> RequestOutput:
        """The engine's output as the client sees it: with max_tokens 0 the one token the engine
        computed to finish the prefill is dropped (vLLM does the same) and the answer ends
        `length`."""
        if not self.prompt_only:
            return out
        finish = out.finish_reason
        if finish is FinishReason.STOP:
            finish = FinishReason.LENGTH
        return replace(
            out, new_token_ids=(), new_text="", logprobs=(), completion_tokens=0,
            finish_reason=finish,
        )

    def echo_text(self, index: int) -> str:
        return self.texts[index // self.n] if self.texts is not None else ""

    def prompt_entries(self, index: int, plp: PromptLogprobs | None) -> list[Entry]:
        """The echoed prompt's legacy entries: its first token with no logprob, then each next
        token's logprob and top `echo_logprobs`."""
        ids = self.prompt_ids[index // self.n]
        k = self.echo_logprobs or 0
        out: list[Entry] = [(ids[0], None, None)] if ids else []
        if plp is not None:
            out.extend(
                (t, lp, list(zip(top_i[:k], top_v[:k], strict=True)))
                for t, lp, top_i, top_v in zip(
                    plp.token_ids, plp.logprobs, plp.top_ids, plp.top_logprobs, strict=True
                )
            )
        return out


def sampled_entries(lps: Sequence[TokenLogprob]) -> list[Entry]:
    return [(lp.token_id, lp.logprob, lp.top) for lp in lps]


def legacy_logprobs(entries: Sequence[Entry], token_text: TokenText, offset: int) -> dict[str, Any]:
    """OpenAI's legacy completions `logprobs`: tokens, token_logprobs, top_logprobs (the top k and
    the chosen token: up to k + 1, as OpenAI documents and vLLM answers), text_offset."""
    tokens = [token_text(t) for t, _, _ in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops: list[dict[str, float] | None] = []
    for (_, lp, top), text in zip(entries, tokens, strict=True):
        if top is None or lp is None:
            tops.append(None)
            continue
        d = {text: max(lp, LOGPROB_FLOOR)}
        for t, v in top:
            d.setdefault(token_text(t), max(v, LOGPROB_FLOOR))
        tops.append(d)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else max(lp, LOGPROB_FLOOR) for _, lp, _ in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(
    plp: PromptLogprobs | None, k: int, token_text: TokenText
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from token
    id to {logprob, rank, decoded_token}: the prompt's own token first, then the top k."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    if plp is None:
        return out
    for t, lp, rank, top_i, top_v in zip(
        plp.token_ids, plp.logprobs, plp.ranks, plp.top_ids, plp.top_logprobs, strict=True
    ):
        d = {str(t): _vllm_entry(lp, rank, token_text(t))}
        for r, (i, v) in enumerate(zip(top_i[:k], top_v[:k], strict=True), start=1):
            d.setdefault(str(i), _vllm_entry(v, r, token_text(i)))
        out.append(d)
    return out


def _vllm_entry(lp: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": max(lp, LOGPROB_FLOOR), "rank": rank, "decoded_token": text}


def check_prompt_fields(
    echo: bool, max_tokens: int | None, prompt_logprobs: int | None, stream: bool
) -> None:
    """The 400s of the prompt fields' combinations (vLLM's rules)."""
    if max_tokens == 0 and not echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 is allowed only with echo: the prompt alone)",
            param="max_tokens",
        )
    if prompt_logprobs is not None and stream:
        raise bad_request(
            "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
        )


def completion_ask(
    prompts: Sequence[str | list[int]],
    prompt_ids: list[list[int]],
    n: int,
    echo: bool,
    logprobs: int | None,
    prompt_logprobs: int | None,
    max_tokens: int,
    decode: Callable[[list[int]], str],
) -> PromptAsk | None:
    """A completions request's ask (None: nothing about its prompt). An echoed text prompt is
    shown as sent; token ids as they decode (vLLM's way)."""
    if not echo and prompt_logprobs is None:
        return None
    texts = None
    if echo:
        texts = [p if isinstance(p, str) else decode(p) for p in prompts]
    return PromptAsk(
        prompt_ids,
        n,
        texts,
        echo_logprobs=logprobs if echo else None,
        field_k=prompt_logprobs,
        prompt_only=echo and max_tokens == 0,
    )


def engine_k(echo: bool, logprobs: int | None, prompt_logprobs: int | None) -> int | None:
    """The top-k a completions request's prompt is scored with (None: not scored)."""
    ks = [k for k in ((logprobs if echo else None), prompt_logprobs) if k is not None]
    return max(ks) if ks else None
