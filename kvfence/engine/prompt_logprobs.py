"""Prompt logprobs: which prompt positions a step scores, the batched log_softmax / rank / top-k
over their logits, and each sequence's scores kept as tensors until its first output carries
them (one `tolist` per request, never a Python loop over tokens in the step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfence.engine.request import PromptLogprobs

# A request's prompt tokens x (k + 1) entries at most: what its answer carries grows with both,
# so admission refuses more with a 400 (lm-eval's 2,048-token windows at k = 1 use 4,096).
MAX_PROMPT_LOGPROB_ENTRIES = 262_144
# Logits rows scored at once: a step's extra memory stays BLOCK_ROWS x vocab floats however long
# the chunk (a loop over blocks of rows, each one batched op).
BLOCK_ROWS = 256
NO_SCORES = (0, 0)


def prompt_entries(prompt_len: int, k: int) -> int:
    return prompt_len * (k + 1)


@dataclass
class ScoreBlock:
    """The scores of consecutive scored positions (one step's, or one sequence's)."""

    chosen: torch.Tensor  # [N] float32: log p(token at position + 1)
    ranks: torch.Tensor  # [N] int64: 1 + how many tokens the model found likelier
    top_ids: torch.Tensor  # [N, K] int64
    top_logprobs: torch.Tensor  # [N, K] float32

    def rows(self, lo: int, hi: int, k: int) -> ScoreBlock:
        return ScoreBlock(
            self.chosen[lo:hi], self.ranks[lo:hi], self.top_ids[lo:hi, :k],
            self.top_logprobs[lo:hi, :k],
        )

    @staticmethod
    def cat(blocks: list[ScoreBlock]) -> ScoreBlock:
        return ScoreBlock(
            torch.cat([b.chosen for b in blocks]),
            torch.cat([b.ranks for b in blocks]),
            torch.cat([b.top_ids for b in blocks]),
            torch.cat([b.top_logprobs for b in blocks]),
        )


def score(logits: torch.Tensor, targets: torch.Tensor, k: int) -> ScoreBlock:
    """logits [N, V] float32 at N positions; targets [N] the tokens that followed them."""
    logp = logits.log_softmax(dim=-1)
    chosen = logp.gather(1, targets[:, None].to(logp.device)).squeeze(1)
    ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
    if k > 0:
        top = logp.topk(k, dim=-1)
        ids, vals = top.indices, top.values
    else:
        ids = torch.empty((len(targets), 0), dtype=torch.int64)
        vals = torch.empty((len(targets), 0), dtype=torch.float32)
    return ScoreBlock(chosen.cpu(), ranks.cpu(), ids.cpu(), vals.cpu())


class PromptScores:
    """One sequence's prompt logprobs so far: positions [0, scored) scored tokens [1, scored].
    On a decode worker they arrive whole from prefill (`ready`)."""

    def __init__(self, k: int, prompt_ids: tuple[int, ...]) -> None:
        self.k = k
        self.prompt_ids = prompt_ids
        self.scored = 0
        self.parts: list[ScoreBlock] = []
        self.ready: PromptLogprobs | None = None
        self.sent = False

    @property
    def complete(self) -> bool:
        return self.ready is not None or self.scored >= len(self.prompt_ids) - 1

    def add(self, block: ScoreBlock, lo: int, hi: int) -> None:
        self.parts.append(block.rows(lo, hi, self.k))
        self.scored += hi - lo

    def result(self) -> PromptLogprobs:
        """The whole prompt's logprobs (every position scored). Reads only: a prefill's sender
        thread asks for them while the engine thread may send its client's final output."""
        assert self.complete, "prompt logprobs asked for before the prompt was scored"
        if self.ready is not None:
            return self.ready
        b = ScoreBlock.cat(self.parts) if self.parts else _empty(self.k)
        return PromptLogprobs(
            self.prompt_ids[1:],
            tuple(b.chosen.tolist()),
            tuple(b.ranks.tolist()),
            tuple(map(tuple, b.top_ids.tolist())),
            tuple(map(tuple, b.top_logprobs.tolist())),
        )

    def take(self) -> PromptLogprobs | None:
        """The result, once: for the first output the client sees."""
        if self.sent or not self.complete:
            return None
        self.sent = True
        return self.result()


def _empty(k: int) -> ScoreBlock:
    return ScoreBlock(
        torch.empty(0), torch.empty(0, dtype=torch.int64),
        torch.empty((0, k), dtype=torch.int64), torch.empty((0, k)),
    )


def scored_range(scores: PromptScores | None, start: int, length: int) -> tuple[int, int]:
    """The positions a chunk [start, start + length) scores: those whose next token is a prompt
    token not scored yet (a recompute after preemption scores nothing twice). The last prompt
    position is not among them: its logits sample the first output token."""
    if scores is None or scores.ready is not None:
        return NO_SCORES
    lo = max(start, scores.scored)
    hi = min(start + length, len(scores.prompt_ids) - 1)
    if lo >= hi:
        return NO_SCORES
    assert lo == scores.scored, "a prompt position would be skipped (a cached prefix?)"
    return lo, hi


def keep_scores(scored: list, block: ScoreBlock | None) -> None:
    """A step's scores into each scored chunk's sequence (chunks in the runner's row order)."""
    if block is None:
        return
    at = 0
    for c in scored:
        n = c.scored[1] - c.scored[0]
        c.seq.prompt_scores.add(block, at, at + n)
        at += n


# The key of DONE's first-token entry that carries the prompt's logprobs from prefill to decode.
DONE_KEY = "prompt"
MISSING = "prompt_logprobs_missing"


def attach(first_logprobs: dict, scores: PromptScores | None) -> dict:
    """Prefill: the scored prompt into DONE's first-token entry (unchanged when none was asked)."""
    if scores is None:
        return first_logprobs
    return {**first_logprobs, DONE_KEY: scores.result().to_dict()}


def receive(scores: PromptScores | None, first_logprobs: dict) -> str | None:
    """Decode: take the prompt logprobs DONE carried; the reason they are unusable (absent,
    malformed, not this prompt's or not its k), or None (usable, or none was asked for)."""
    if scores is None:
        return None
    data = first_logprobs.get(DONE_KEY)
    if data is None:
        return "prefill sent no prompt logprobs"
    try:
        plp = PromptLogprobs.from_dict(data)
    except (ValueError, TypeError, KeyError) as e:
        return f"prefill's prompt logprobs are malformed ({e})"
    if plp.token_ids != scores.prompt_ids[1:] or any(len(t) != scores.k for t in plp.top_ids):
        return "prefill's prompt logprobs are not this prompt's"
    scores.ready = plp
    return None
