"""Text sources and in-context recall prompts for the kvfence-tiny model.

Owns the two disjoint prompt styles: "recipe" (stdlib docstrings, build keys) and "heldout".
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import string
import warnings
from collections.abc import Callable
from dataclasses import dataclass

VALUE_ALPHABET = string.ascii_letters + string.digits

# Modules whose docstrings feed the tokenizer and the recipe's own check. A fixed list (not
# pkgutil discovery) keeps the text, and therefore the tokenizer, stable for a Python version.
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "gzip", "hashlib", "heapq", "html", "http.client",
    "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "operator", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "shlex", "shutil",
    "socket", "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "typing", "unittest",
    "urllib.parse", "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip

# Build-time key vocabulary (software identifiers joined by "_").
RECIPE_KEY_HEADS: tuple[str, ...] = (
    "user", "order", "api", "session", "account", "invoice", "device", "ticket",
    "build", "cache", "client", "server", "batch", "job", "node", "payment",
)  # fmt: skip
RECIPE_KEY_TAILS: tuple[str, ...] = (
    "id", "key", "ref", "code", "token", "hash", "tag", "serial", "secret", "pin",
)  # fmt: skip

# Held-out key vocabulary: two lowercase nature words joined by a space; no word is shared
# with the recipe keys.
HELDOUT_KEY_HEADS: tuple[str, ...] = (
    "amber", "cobalt", "crimson", "velvet", "silent", "hollow", "golden", "frozen",
    "rustic", "misty", "scarlet", "quiet", "northern", "wild", "ivory", "copper",
)  # fmt: skip
HELDOUT_KEY_TAILS: tuple[str, ...] = (
    "heron", "lantern", "harbor", "meadow", "violin", "orchard", "canyon", "glacier",
    "beacon", "thistle", "falcon", "willow", "pebble", "comet", "fern", "otter",
)  # fmt: skip

# Held-out filler: template sentences over a small everyday-English vocabulary.
_NOUNS: tuple[str, ...] = (
    "river", "baker", "garden", "village", "teacher", "mountain", "kitten", "market",
    "sailor", "window", "forest", "letter", "painter", "bridge", "farmer", "candle",
    "island", "kitchen", "traveler", "library", "storm", "wagon", "shepherd", "valley",
    "clock", "poet", "lake", "festival", "child", "harvest", "road", "tower",
)  # fmt: skip
_ADJS: tuple[str, ...] = (
    "old", "bright", "small", "gentle", "busy", "distant", "warm", "narrow", "tall",
    "cheerful", "dusty", "green", "sleepy", "careful", "broad", "lonely",
)  # fmt: skip
_VERBS: tuple[str, ...] = (
    "visited", "watched", "followed", "painted", "crossed", "remembered", "carried",
    "found", "praised", "ignored", "repaired", "described", "passed", "welcomed",
)  # fmt: skip
_PREPS: tuple[str, ...] = ("near", "behind", "beside", "across", "under", "beyond", "above")
_ADVS: tuple[str, ...] = ("slowly", "quietly", "often", "again", "gladly", "early", "later")
_OPENERS: tuple[str, ...] = (
    "In the morning", "After the rain", "Every summer", "Long ago", "That evening",
    "On market day", "Before dawn", "Later that week",
)  # fmt: skip


@dataclass(frozen=True)
class RecallPrompt:
    """One recall item: the prompt text (no BOS), the queried key and the value to reproduce."""

    text: str
    key: str
    value: str
    n_records: int


def random_value(rng: random.Random) -> str:
    """A fresh 12-16 character alphanumeric value."""
    return "".join(rng.choice(VALUE_ALPHABET) for _ in range(rng.randint(12, 16)))


def stdlib_paragraphs() -> list[str]:
    """Docstring paragraphs of STDLIB_MODULES, whitespace-collapsed, in a deterministic order."""
    seen: set[str] = set()
    out: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in STDLIB_MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            docs = [inspect.getdoc(mod) or ""]
            for attr in sorted(vars(mod)):
                obj = getattr(mod, attr, None)
                if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
                    docs.append(inspect.getdoc(obj) or "")
            for doc in docs:
                for para in re.split(r"\n\s*\n", doc):
                    para = " ".join(para.split())
                    if len(para) >= 40 and para not in seen:
                        seen.add(para)
                        out.append(para)
    return out


def heldout_sentence(rng: random.Random) -> str:
    """One template sentence of held-out filler."""
    n1, n2, n3 = (rng.choice(_NOUNS) for _ in range(3))
    a1, a2 = rng.choice(_ADJS), rng.choice(_ADJS)
    v, p, adv = rng.choice(_VERBS), rng.choice(_PREPS), rng.choice(_ADVS)
    form = rng.randrange(4)
    if form == 0:
        return f"The {a1} {n1} {v} the {n2} {p} the {n3}."
    if form == 1:
        return f"{rng.choice(_OPENERS)}, a {a1} {n1} {adv} {v} the {a2} {n2}."
    if form == 2:
        return f"Nobody {v} the {n1} {p} the {a1} {n2}, so the {n3} {adv} did."
    return f"The {n1} and the {a2} {n2} {v} a {n3} {p} the {a1} {rng.choice(_NOUNS)}."


def heldout_paragraph(rng: random.Random) -> str:
    return " ".join(heldout_sentence(rng) for _ in range(rng.randint(2, 6)))


def recipe_key(rng: random.Random) -> str:
    return f"{rng.choice(RECIPE_KEY_HEADS)}_{rng.choice(RECIPE_KEY_TAILS)}"


def heldout_key(rng: random.Random) -> str:
    return f"{rng.choice(HELDOUT_KEY_HEADS)} {rng.choice(HELDOUT_KEY_TAILS)}"


class PromptMaker:
    """Builds recall prompts of a target token length for one style ("recipe" or "heldout")."""

    def __init__(self, style: str, count_tokens: Callable[[str], int]) -> None:
        if style not in ("recipe", "heldout"):
            raise ValueError(f"unknown style {style!r}")
        self.style = style
        self.count_tokens = count_tokens
        self._stdlib = stdlib_paragraphs() if style == "recipe" else []

    def _paragraph(self, rng: random.Random) -> str:
        if self.style == "recipe":
            return rng.choice(self._stdlib)
        return heldout_paragraph(rng)

    def _key(self, rng: random.Random) -> str:
        return recipe_key(rng) if self.style == "recipe" else heldout_key(rng)

    def make(self, rng: random.Random, lo: int, hi: int) -> RecallPrompt:
        """A prompt whose token count (plus one BOS) lies in [lo, hi].

        Layout: filler paragraphs, one per line, with 1-4 "key: value" lines placed between
        them (sometimes adjacent); the last line is a queried key followed by ":".
        """
        while True:
            target = rng.randint(lo, hi)
            n_records = rng.randint(1, 4)
            keys: list[str] = []
            while len(keys) < n_records:
                k = self._key(rng)
                if k not in keys:
                    keys.append(k)
            values = [random_value(rng) for _ in keys]
            records = [f"{k}: {v}\n" for k, v in zip(keys, values, strict=True)]
            query_idx = rng.randrange(n_records)
            tail = f"{keys[query_idx]}:"
            budget = target - 1 - sum(self.count_tokens(r) for r in records)
            budget -= self.count_tokens(tail)
            paras: list[str] = []
            used = 0
            while used < budget:
                para = self._paragraph(rng) + "\n"
                paras.append(para)
                used += self.count_tokens(para)
            # Keep the queried record away from the very end so recall spans some distance.
            slots = sorted(rng.randint(0, max(0, len(paras) - 1)) for _ in records)
            rng.shuffle(records)
            pieces = list(paras)
            for slot, rec in sorted(zip(slots, records, strict=True), key=lambda t: -t[0]):
                pieces.insert(slot, rec)
            text = "".join(pieces) + tail
            n = self.count_tokens(text) + 1
            if lo <= n <= hi:
                return RecallPrompt(text, keys[query_idx], values[query_idx], n_records)


def recalled(continuation: str, value: str) -> bool:
    """Exact recall: the greedy continuation starts with the value (one leading space allowed)."""
    if continuation.startswith(" "):
        continuation = continuation[1:]
    return continuation.startswith(value)
