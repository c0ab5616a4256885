"""How servers word a prompt's token count in a context-length refusal, and reading it back."""

from __future__ import annotations

import re

# How the common servers phrase a prompt's token count in a context-length error.
_COUNT_PATTERNS = (
    re.compile(r"(\d+) in the (?:messages|prompt|input)"),
    re.compile(r"prompt (?:has|contains|is|of) (\d+) tokens"),
    re.compile(r"request has (\d+) input tokens"),
    re.compile(r"input (?:length|tokens?)\D{0,12}(\d+)", re.I),
)


def count_from_error(message: str) -> int | None:
    for pattern in _COUNT_PATTERNS:
        m = pattern.search(message)
        if m:
            return int(m.group(1))
    return None
