"""Canary markers for leak tests: unique random strings per request, prompts full of them with
recall cues, and `find_leaks`, which spots any other request's canary (or an 8-char piece) in an
output. Used by `kvfence leakcheck`, the defense-in-depth tests and the chaos soak."""

from __future__ import annotations

import math
import random
import re
import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

# Crockford base32: no I, L, O or U, so a body never spells an English word and never reads as
# a different canary after a case change.
ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
PREFIX = "CNRY"
BODY_LEN = 16
# A leak is any run of this many body characters: 32**8 ~ 1.1e12 values, so a chance match
# against even 10**5 indexed pieces is ~1e-7 per output position, while a model that copies
# only part of a canary (a truncated or merged span) is still caught.
MIN_FRAGMENT = 8
# Keys come from one shared space for all requests on purpose: a cue that could be answered
# from a foreign request's KV (same key, different value) makes a leak more likely to show.
KEY_SPACE = 10_000
# Fallback when no tokenizer is at hand: random base32 costs ~1.5-2 chars/token in common BPE
# vocabularies and English ~4; erring low keeps "legal length" prompts legal.
DEFAULT_CHARS_PER_TOKEN = 1.5
PAD_UNIT = " x"  # one token in common BPE vocabularies, and additive when repeated

TokenCounter = Callable[[str], int]

_RUN = re.compile(f"[{ALPHABET}]{{{MIN_FRAGMENT},}}")
_WORDS = (
    "the a small quiet green early late river garden window market letter table station "
    "bridge morning evening kitchen teacher painter farmer walks finds carries opens keeps "
    "watches near under behind across beside through after before with and then again slowly "
    "today"
).split()


def approx_counter(chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> TokenCounter:
    """A token counter for when the real tokenizer is out of reach; overestimates on purpose."""

    def count(text: str) -> int:
        return math.ceil(len(text) / chars_per_token)

    return count


@dataclass(frozen=True)
class Owner:
    tenant: str
    request_id: str


@dataclass(frozen=True)
class Leak:
    """Text of `owner_request_id`'s canary found in `reader_request_id`'s output."""

    reader_request_id: str
    reader_tenant: str | None
    owner_request_id: str
    owner_tenant: str
    canary: str
    fragment: str  # the longest run of the canary's body found in the output
    whole: bool  # the full body appeared

    @property
    def cross_tenant(self) -> bool:
        return self.reader_tenant != self.owner_tenant

    @property
    def kind(self) -> str:
        return "cross_tenant" if self.cross_tenant else "same_tenant_other_request"

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "reader_request_id": self.reader_request_id,
            "reader_tenant": self.reader_tenant,
            "owner_request_id": self.owner_request_id,
            "owner_tenant": self.owner_tenant,
            "canary": self.canary,
            "fragment": self.fragment,
            "whole": self.whole,
        }


class CanaryRegistry:
    """Every canary minted in a run, who owns it, and an index of all its 8-char body pieces."""

    def __init__(self, rng: random.Random | None = None) -> None:
        # A seeded Random makes a run reproducible; by default canaries are unguessable.
        self._rng: random.Random = rng if rng is not None else secrets.SystemRandom()
        self._lock = threading.Lock()  # the chaos soak mints from several threads
        self._owner: dict[str, Owner] = {}  # canary -> owner
        self._tenant_of: dict[str, str] = {}  # request id -> tenant
        self._by_request: dict[str, list[str]] = {}
        self._pieces: dict[str, list[str]] = {}  # 8-char body piece -> canaries holding it

    def __len__(self) -> int:
        return len(self._owner)

    def register(self, tenant: str, request_id: str) -> None:
        """Record a reader, even one that never gets a canary (a bare cue)."""
        with self._lock:
            known = self._tenant_of.setdefault(request_id, tenant)
            if known != tenant:
                raise ValueError(f"request {request_id!r} is already registered to {known!r}")
            self._by_request.setdefault(request_id, [])

    def draw(self) -> str:
        """A fresh random canary, not yet anyone's (see `add`)."""
        with self._lock:
            return PREFIX + "".join(self._rng.choice(ALPHABET) for _ in range(BODY_LEN))

    def add(self, tenant: str, request_id: str, canary: str) -> bool:
        """Make `canary` this request's; False if it is already taken (draw another)."""
        self.register(tenant, request_id)
        body = canary[len(PREFIX) :]
        if not canary.startswith(PREFIX) or len(body) != BODY_LEN:
            raise ValueError(f"not a canary: {canary!r}")
        with self._lock:
            if canary in self._owner:
                return False
            self._owner[canary] = Owner(tenant, request_id)
            self._by_request[request_id].append(canary)
            for i in range(BODY_LEN - MIN_FRAGMENT + 1):
                self._pieces.setdefault(body[i : i + MIN_FRAGMENT], []).append(canary)
        return True

    def mint(self, tenant: str, request_id: str) -> str:
        while True:
            canary = self.draw()
            if self.add(tenant, request_id, canary):
                return canary

    def owner(self, canary: str) -> Owner:
        return self._owner[canary]

    def tenant_of(self, request_id: str) -> str | None:
        return self._tenant_of.get(request_id)

    def canaries_of(self, request_id: str) -> list[str]:
        return list(self._by_request.get(request_id, ()))

    def _hits(self, output: str) -> Iterable[tuple[int, list[str]]]:
        # Case-folded: a model may echo a canary in another case, and the alphabet survives it.
        text = output.upper()
        for run in _RUN.finditer(text):
            s = run.group()
            for i in range(len(s) - MIN_FRAGMENT + 1):
                holders = self._pieces.get(s[i : i + MIN_FRAGMENT])
                if holders:
                    yield run.start() + i, holders

    def echoed_own(self, output: str, request_id: str) -> bool:
        """Whether the output repeats a piece of this request's own canaries (the probe's
        evidence that the model copies its context, so that a leak would show)."""
        return any(
            self._owner[c].request_id == request_id for _, cs in self._hits(output) for c in cs
        )

    def find_leaks(self, output: str, request_id: str, tenant: str | None = None) -> list[Leak]:
        """Every other request's canary with at least MIN_FRAGMENT body chars in `output`.

        A piece that this request's own canaries also hold is never a leak: a collision of
        random pieces must not be reported as one."""
        reader_tenant = tenant if tenant is not None else self.tenant_of(request_id)
        text = output.upper()
        spans: dict[str, list[tuple[int, int]]] = {}  # canary -> [(start, end)] in output
        with self._lock:
            hits = list(self._hits(output))
        for pos, holders in hits:
            if any(self._owner[c].request_id == request_id for c in holders):
                continue
            for c in holders:
                runs = spans.setdefault(c, [])
                end = pos + MIN_FRAGMENT
                if runs and pos <= runs[-1][1]:
                    runs[-1] = (runs[-1][0], end)
                else:
                    runs.append((pos, end))
        leaks = []
        for canary, runs in spans.items():
            start, end = max(runs, key=lambda r: r[1] - r[0])
            fragment = text[start:end]
            owner = self._owner[canary]
            leaks.append(
                Leak(
                    reader_request_id=request_id,
                    reader_tenant=reader_tenant,
                    owner_request_id=owner.request_id,
                    owner_tenant=owner.tenant,
                    canary=canary,
                    fragment=fragment,
                    whole=canary[len(PREFIX) :] in fragment,
                )
            )
        return leaks


@dataclass(frozen=True)
class CanaryPrompt:
    body: str  # records and filler, each line ending in a newline
    pad: int  # PAD_UNITs between the body and the cue
    cue: str  # the final `key:`
    tenant: str
    request_id: str
    canaries: tuple[str, ...]
    expected: str | None  # the canary a faithful copy of the context answers; None: bare cue
    tokens: int  # by the counter the builder was given (exact or approximate)

    @property
    def text(self) -> str:
        return self.body + pad_block(self.pad) + self.cue

    def padded(self, pad: int, tokens: int | None = None) -> CanaryPrompt:
        """The same prompt (same canaries) with another pad: steps its length a token at a
        time for callers that can only measure it remotely."""
        pad = max(pad, 0)
        guess = self.tokens + (pad + (pad > 0)) - (self.pad + (self.pad > 0))  # + its newline
        return replace(self, pad=pad, tokens=guess if tokens is None else tokens)


def pad_block(n: int) -> str:
    # On its own line, so the cue still starts a line as every record key does.
    return PAD_UNIT * n + "\n" if n > 0 else ""


def _key(i: int) -> str:
    return f"account {i} code"


def _filler(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(6, 12))]
    return " ".join(words).capitalize() + ".\n"


def build_prompt(
    registry: CanaryRegistry,
    tenant: str,
    request_id: str,
    target_tokens: int,
    *,
    rng: random.Random,
    count_tokens: TokenCounter | None = None,
    records: bool = True,
    filler_every: int = 3,
) -> CanaryPrompt:
    """`key: CANARY` lines with a filler sentence after every `filler_every` records, then a
    final `key:` cue naming one of them: `target_tokens` long by `count_tokens` where the pad
    can reach it exactly (always with an additive tokenizer), else just under.

    With `records=False` the prompt is filler and a cue only (a *bare cue*): no canary belongs
    to it, so any canary in its output came from someone else's KV."""
    count = count_tokens or approx_counter()
    registry.register(tenant, request_id)
    keys = rng.sample(range(KEY_SPACE), k=min(KEY_SPACE, target_tokens // 4 + 1))
    pieces: list[tuple[str, int | None]] = []  # (line, key)
    key_iter = iter(keys)
    chars = 0
    # Overshoot (4 chars/token covers English-heavy vocabularies), then trim by real counts.
    budget = target_tokens * 4.0
    while chars < budget:
        want_record = records and (
            filler_every <= 0 or len(pieces) % (filler_every + 1) != filler_every
        )
        k = next(key_iter, None) if want_record else None
        if k is not None:
            # Drawn now so that counts see real text; owned only if the line is kept.
            line = f"{_key(k)}: {registry.draw()}\n"
        else:  # past KEY_SPACE records a long prompt goes on with filler
            line = _filler(rng)
        pieces.append((line, k))
        chars += len(line)
    used = {p[1] for p in pieces}
    cue_spare = next((k for k in keys if k not in used), KEY_SPACE)  # a key no line holds

    def cue_of(parts: list[tuple[str, int | None]]) -> int:
        with_key = [p[1] for p in parts if p[1] is not None]
        return with_key[len(with_key) // 2] if with_key else cue_spare

    def render(parts: list[tuple[str, int | None]], pad: int) -> str:
        return "".join(p[0] for p in parts) + pad_block(pad) + f"{_key(cue_of(parts))}:"

    # Trim whole lines from the end until it fits: a few recounts even for megatoken prompts.
    for _ in range(64):
        n = count(render(pieces, 0))
        if n <= target_tokens or not pieces:
            break
        excess = (n - target_tokens) * sum(len(p[0]) for p in pieces) / max(n, 1)
        drop, dropped = 0, 0.0
        while drop < len(pieces) and (dropped < excess or drop == 0):
            drop += 1
            dropped += len(pieces[-drop][0])
        pieces = pieces[:-drop]

    # Then pad up to the target; a pad that overshoots (a merging tokenizer) steps back.
    def fit_pad(parts: list[tuple[str, int | None]]) -> tuple[int, int]:
        pad = 0
        for _ in range(16):
            n = count(render(parts, pad))
            if n == target_tokens or (n > target_tokens and pad == 0):
                return pad, n
            pad = pad - 1 if n > target_tokens else pad + target_tokens - n
        while pad > 0 and count(render(parts, pad)) > target_tokens:
            pad -= 1
        return pad, count(render(parts, pad))

    pad, n = fit_pad(pieces)
    for _ in range(3):
        if n == target_tokens or len(pieces) < 2:
            break
        # A pad's own newline can step over the target by one: give up a line and retry.
        shorter = pieces[:-1]
        pad2, n2 = fit_pad(shorter)
        if n2 <= target_tokens and n2 > n:
            pieces, pad, n = shorter, pad2, n2
        else:
            break

    cue = cue_of(pieces)
    lines: list[str] = []
    canaries: list[str] = []
    expected = None
    for text, k in pieces:
        if k is not None:
            c = text.split(": ", 1)[1].rstrip("\n")
            if not registry.add(tenant, request_id, c):  # taken since drawn: ~never
                c = registry.mint(tenant, request_id)
                text = f"{_key(k)}: {c}\n"
            canaries.append(c)
            if k == cue:
                expected = c
        lines.append(text)
    body = "".join(lines)
    cue_line = f"{_key(cue)}:"
    return CanaryPrompt(
        body=body,
        pad=pad,
        cue=cue_line,
        tenant=tenant,
        request_id=request_id,
        canaries=tuple(canaries),
        expected=expected,
        tokens=count(body + pad_block(pad) + cue_line),
    )


__all__ = [
    "ALPHABET",
    "BODY_LEN",
    "MIN_FRAGMENT",
    "PAD_UNIT",
    "PREFIX",
    "CanaryPrompt",
    "CanaryRegistry",
    "Leak",
    "Owner",
    "TokenCounter",
    "approx_counter",
    "build_prompt",
    "pad_block",
]
