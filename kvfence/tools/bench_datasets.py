"""Workloads for `kvfence bench serve`: random prompts, SGLang-style generated shared prefixes
(a system prompt per group, many questions each) and multi-turn chat, spread over tenants.

A workload is a list of sessions; a session's turns go out one after another, each turn's prompt
being the previous prompt, its answer and a new question (multi-turn), so prefix reuse within a
conversation is real. Sessions run concurrently.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

Prompt = list[int] | str
DATASETS = ("random", "shared-prefix", "multi-turn")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Session:
    api_key: str | None
    turns: tuple[Prompt, ...]  # the first prompt, then each follow-up question
    extra: dict[str, Any] = field(default_factory=dict)  # body fields, e.g. cache_salt


@dataclass(frozen=True)
class DatasetArgs:
    dataset: str
    num_prompts: int
    input_len: int
    vocab: int
    seed: int
    as_text: bool
    api_keys: tuple[str | None, ...] = (None,)
    cache_salt: str = "none"  # none | per-tenant | shared (the unsafe configurations' twin)
    # shared-prefix (SGLang's bench_serving --dataset-name generated-shared-prefix)
    num_groups: int = 8
    prompts_per_group: int = 8
    system_prompt_len: int = 1024
    question_len: int = 128
    one_system_prompt: bool = False  # every group shares one public system prompt
    # multi-turn
    num_turns: int = 4
    # text prompts: random 3-letter words (about a token each in BPE vocabularies), or "ids":
    # words `w<id>` that a word-level benchmark tokenizer maps one to one
    text_words: str = "letters"


def random_prompt(
    rng: random.Random, n: int, vocab: int, as_text: bool, words: str = "letters"
) -> Prompt:
    """n random token ids (ids 0..9 avoided: specials live there in most vocabularies), or n
    random words for servers that take text only (see DatasetArgs.text_words)."""
    if as_text and words == "ids":
        return " ".join(f"w{rng.randrange(10, vocab)}" for _ in range(n))
    if as_text:
        return " ".join("".join(rng.choices(_LETTERS, k=3)) for _ in range(n))
    return [rng.randrange(10, vocab) for _ in range(n)]


def join(*parts: Prompt) -> Prompt:
    if all(isinstance(p, list) for p in parts):
        return [t for p in parts for t in p]  # type: ignore[union-attr]
    return " ".join(str(p) for p in parts if p)


def salt_for(api_key: str | None, mode: str) -> dict[str, Any]:
    """vLLM's request field `cache_salt`: one per tenant (what a careful gateway sends), or one
    for everybody (what a gateway that loses it amounts to)."""
    if mode == "none":
        return {}
    if mode == "shared":
        return {"cache_salt": "everyone"}
    digest = hashlib.sha256((api_key or "").encode()).hexdigest()[:16]
    return {"cache_salt": f"tenant-{digest}"}


def make_sessions(a: DatasetArgs) -> list[Session]:
    base = random.Random(a.seed)
    keys = a.api_keys or (None,)

    def draw(n: int, as_text: bool) -> Prompt:
        return random_prompt(base, n, a.vocab, as_text, a.text_words)

    if a.dataset == "random":
        return [
            Session(
                keys[i % len(keys)],
                (draw(a.input_len, a.as_text),),
                salt_for(keys[i % len(keys)], a.cache_salt),
            )
            for i in range(a.num_prompts)
        ]
    if a.dataset == "shared-prefix":
        one = draw(a.system_prompt_len, a.as_text)
        sessions = []
        for g in range(a.num_groups):
            key = keys[g % len(keys)]
            system = one if a.one_system_prompt else draw(a.system_prompt_len, a.as_text)
            for _ in range(a.prompts_per_group):
                q = draw(a.question_len, a.as_text)
                sessions.append(Session(key, (join(system, q),), salt_for(key, a.cache_salt)))
        base.shuffle(sessions)  # groups interleave, as SGLang's generator does
        return sessions
    if a.dataset == "multi-turn":
        if not a.as_text:
            raise ValueError("multi-turn appends each answer's text: use text prompts")
        return [
            Session(
                keys[i % len(keys)],
                (draw(a.input_len, True),)
                + tuple(draw(a.question_len, True) for _ in range(a.num_turns - 1)),
                salt_for(keys[i % len(keys)], a.cache_salt),
            )
            for i in range(a.num_prompts)
        ]
    raise ValueError(f"unknown dataset {a.dataset!r}; choose from {', '.join(DATASETS)}")


def shared_prefixes(sessions: list[Session], system_prompt_len: int) -> list[Prompt]:
    """The distinct system prompts of a shared-prefix workload: what an operator would declare
    public with `--shared-prefix-file`."""
    out: list[Prompt] = []
    for s in sessions:
        first = s.turns[0]
        head = (
            first[:system_prompt_len]
            if isinstance(first, list)
            else " ".join(first.split()[:system_prompt_len])
        )
        if head not in out:
            out.append(head)
    return out
