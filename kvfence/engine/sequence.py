"""Sequence: the engine's live state of one admitted request (tokens, pages, grant, status)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvfence.engine.admission import Admitted
from kvfence.engine.prompt_logprobs import PromptScores
from kvfence.engine.request import FinishReason, RequestOutput, TokenLogprob
from kvfence.kv.pool import Grant
from kvfence.kv.prefix import PageChain
from kvfence.model.tokenizer import IncrementalDetokenizer
from kvfence.structured.grammar import Matcher

if TYPE_CHECKING:
    from kvfence.lora.checkpoint import LoraAdapter


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    RUNNING = "running"  # holds pages under its grant, scheduled every step
    HANDOFF = "handoff"  # holds pages a KV transfer reads (prefill) or writes (decode); never
    #                      scheduled or preempted until the PD layer commits or releases it
    FINISHED = "finished"  # pages returned; its sink has seen the final output


class SeqMode(enum.Enum):
    FULL = "full"  # unified: prefill and decode here
    PREFILL_ONLY = "prefill_only"  # compute the prompt and the first token, then hand off
    DECODE_ONLY = "decode_only"  # reserve pages for the prompt, wait for its KV, then decode


@dataclass(eq=False)
class Sequence:
    admitted: Admitted
    sink: Callable[[RequestOutput], None]
    mode: SeqMode
    detok: IncrementalDetokenizer
    generator: torch.Generator | None = None
    status: SeqStatus = SeqStatus.WAITING
    grant: Grant | None = None
    pages: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed: int = 0  # tokens whose K/V are in the pool
    text: str = ""  # generated text not yet sent (held back while a stop string may be forming)
    sent_text_len: int = 0
    sent_ids: int = 0  # output tokens already reported to the sink
    client_done: bool = False  # the sink has had its final output (I5: exactly once)
    finish_reason: FinishReason | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_preemptions: int = 0
    # Prefix cache (FULL mode only): the keys of its full pages; how many leading `pages` are
    # cache pages it references (matched, or its own sealed) rather than pages its grant owns;
    # sealing stops for good once the cache refused a page (a twin computed it first).
    chain: PageChain | None = None
    num_sealed: int = 0
    may_seal: bool = True
    cached_tokens: int = 0  # prompt tokens reused at the admission that produced its output
    # Structured output: its place in its grammar, advanced by every token it keeps. Preemption
    # keeps its tokens (recompute), so the state stays true without a replay.
    matcher: Matcher | None = None
    # Prompt logprobs, when asked for: scored as its prompt is computed here, or (decode) as
    # prefill computed them.
    prompt_scores: PromptScores | None = None
    # The engine's clock (time.monotonic) when it took the request in and when its first token
    # came out: what the latency targets are measured from (kvfence/engine/deadlines.py).
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def own_pages(self) -> list[int]:
        """The pages its grant owns (all but the leading cache pages)."""
        return self.pages[self.num_sealed :]

    def __post_init__(self) -> None:
        req = self.admitted.request
        if not self.token_ids:
            self.token_ids = list(req.prompt_token_ids)
        if req.sampling.prompt_logprobs is not None and self.prompt_scores is None:
            self.prompt_scores = PromptScores(req.sampling.prompt_logprobs, req.prompt_token_ids)

    @property
    def request_id(self) -> str:
        return self.admitted.request.request_id

    @property
    def tenant(self) -> str:
        return self.admitted.request.tenant

    @property
    def lora(self) -> LoraAdapter | None:
        return self.admitted.request.lora

    @property
    def prompt_len(self) -> int:
        return self.admitted.prompt_len

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.num_uncomputed == 1 and self.num_computed > 0
