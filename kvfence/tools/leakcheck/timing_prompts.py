"""The timing probe's prompts, from the server's own vocabulary: a primed prompt and a fresh one
must differ as tokens from the first token on, or the "fresh" one is a cache hit too. Random
base32 words do that under byte-level BPE, but under a word-level vocabulary every one of them
is the same unknown token, so every prompt is the primed one. Where the server offers
`/tokenize`, the words are checked there and, when they fail, drawn from what `/detokenize`
says the vocabulary holds; every pair is checked again before it is sent."""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run

_BASE32 = "ABCDEFGHJKMNPQRSTVWXYZ0123456789"
_SAMPLE_WORDS = 48
_DETOKENIZE_CHUNK = 512
_DETOKENIZE_MAX_IDS = 1 << 17
_MIN_VOCABULARY = 64
_MAX_WORD_CHARS = 24


@dataclass(frozen=True)
class Prompts:
    """How this run's timing prompts are made: from `words` when the server's vocabulary is
    known (None: random base32 words), `tokens_per_word` as the server counts them."""

    words: tuple[str, ...] | None
    tokens_per_word: float | None  # None: no tokenizer, sized by characters
    checked: bool  # /tokenize checks every pair
    how: str  # for the report
    lead: int = 0  # special tokens the server adds even when asked not to (a BOS)

    def text(self, rng: random.Random, tokens: int, chars_per_token: float) -> str:
        if self.tokens_per_word is None:
            return _base32(rng, int(tokens * chars_per_token))
        n = max(1, int(tokens / self.tokens_per_word))
        if self.words is None:
            return " ".join(_word(rng) for _ in range(n))
        return " ".join(rng.choice(self.words) for _ in range(n))


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(_BASE32) for _ in range(6))


def _base32(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(_word(rng))
        size += 7
    return " ".join(words)


def differ_from_first(a: list[int], b: list[int], lead: int = 0) -> bool:
    """Two prompts share no cached prefix: their first tokens (past `lead`) differ."""
    return len(a) > lead and len(b) > lead and a[lead] != b[lead]


def _varied(ids: list[int], words: int) -> bool:
    """Not one token over and over (the unknown token of a vocabulary that lacks the words)."""
    return len(set(ids)) * 4 >= min(len(ids), words)


async def _tries(run: Run, tenant: Tenant, p: Prompts) -> tuple[bool, float]:
    """(two sample prompts differ from the first token and vary, tokens per word)."""
    a = p.text(run.rng, _SAMPLE_WORDS, 1.0) if p.words else _sample_base32(run.rng)
    b = p.text(run.rng, _SAMPLE_WORDS, 1.0) if p.words else _sample_base32(run.rng)
    ia = await run.api.token_ids(tenant, a)
    ib = await run.api.token_ids(tenant, b)
    if not ia or not ib:
        return False, 1.0
    words = len(a.split())
    ia, ib = ia[p.lead :], ib[p.lead :]
    ok = differ_from_first(ia, ib) and _varied(ia, words) and _varied(ib, words)
    return ok, len(ia) / max(1, words)


def _sample_base32(rng: random.Random) -> str:
    return " ".join(_word(rng) for _ in range(_SAMPLE_WORDS))


async def _vocabulary(run: Run, tenant: Tenant) -> tuple[str, ...]:
    """Words the server's tokenizer knows, read back from `/detokenize` a chunk of ids at a
    time (until the ids run past the vocabulary)."""
    words: dict[str, None] = {}
    for start in range(0, _DETOKENIZE_MAX_IDS, _DETOKENIZE_CHUNK):
        text = await run.api.detokenize(tenant, list(range(start, start + _DETOKENIZE_CHUNK)))
        if text is None:
            break
        for w in text.split():
            if w.isprintable() and len(w) <= _MAX_WORD_CHARS and not w.startswith("<"):
                words[w] = None
    return tuple(words)


async def make_prompts(run: Run, tenant: Tenant) -> Prompts | str:
    """How to build this server's timing prompts, or why no prompts can be built that differ
    as tokens (the probe is then inconclusive, never a pass)."""
    if await run.api.token_ids(tenant, "hello") is None:
        return Prompts(None, None, False, "random base32 words, unchecked (no /tokenize)")
    lead = len(await run.api.token_ids(tenant, "") or [])
    base32 = Prompts(None, 1.0, True, "", lead)
    ok, rate = await _tries(run, tenant, base32)
    if ok:
        return Prompts(None, rate, True, "random base32 words, checked with /tokenize", lead)
    vocab = await _vocabulary(run, tenant)
    if len(vocab) < _MIN_VOCABULARY:
        return (
            "random words tokenize to the same tokens on this server and /detokenize gave "
            f"{len(vocab)} words of its vocabulary: no prompts that differ as tokens"
        )
    words = Prompts(vocab, 1.0, True, "", lead)
    ok, rate = await _tries(run, tenant, words)
    if not ok:
        return "prompts drawn from the server's vocabulary still share their first token"
    how = f"{len(vocab)} words of the server's vocabulary (/detokenize), checked with /tokenize"
    return Prompts(vocab, rate, True, how, lead)


async def fresh_pair(
    run: Run, tenant: Tenant, p: Prompts, tokens: int, chars_per_token: float
) -> tuple[str, str] | None:
    """A prefix to prime and another of equal length, differing as tokens from the first token
    on (checked when the server can tokenize); None when three tries all failed the check."""
    for _ in range(3):
        prefix = p.text(run.rng, tokens, chars_per_token)
        other = p.text(run.rng, tokens, chars_per_token)
        if not p.checked:
            return prefix, other
        ia = await run.api.token_ids(tenant, prefix)
        ib = await run.api.token_ids(tenant, other)
        if ia is not None and ib is not None and differ_from_first(ia, ib, p.lead):
            return prefix, other
    return None
