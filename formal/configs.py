"""The bounded configurations `kvfence check-protocol --config` names: small (CI) and medium."""

from __future__ import annotations

from formal.model import FAULTS, Config, ReqSpec


def config_for(name: str) -> Config:
    if name == "small":
        # Two tenants, two prompts that cannot hold pages at once (so pages are reused) and
        # one over-length prompt (context 3 leaves no room for a 3-token prompt's answer).
        # Decode's prefix cache holds r0's first page (an earlier turn of tenant A): r0
        # references it and reserves one page; eviction may take it whenever no room pins it.
        return Config(
            "small",
            (ReqSpec("A", 2, cached=1), ReqSpec("B", 2), ReqSpec("B", 3)),
            decode_pages=3,
            prefill_pages=3,
            context_length=3,
            faults=tuple((k, 1) for k in FAULTS),
            max_faults=1,
        )
    if name == "medium":
        return Config(
            "medium",
            # Two prompts that can hold pages together, an over-length one, two faults a run.
            (ReqSpec("A", 2), ReqSpec("B", 2), ReqSpec("A", 4)),
            decode_pages=4,
            prefill_pages=4,
            context_length=4,
            faults=tuple((k, 1) for k in FAULTS),
            max_faults=2,
        )
    raise ValueError(f"unknown configuration {name!r}")
