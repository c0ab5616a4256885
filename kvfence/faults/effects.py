"""What each action point does when it fires: the one home of the bugs the twins plant.

Production code never branches on an action point; it passes a value through `Faults.hook` and
gets it back unchanged unless the point fires, in which case the effect registered here returns
the faulty value. An effect receives the value, the firing process's `Firing` (its stall time and
crash action) and the keyword context its hook line passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Firing(Protocol):
    """What an effect may use of the process whose point fired."""

    stall_s: float

    def crash(self, point: str) -> None: ...


Effect = Callable[..., Any]


def _fires(value: Any, firing: Firing, **_: Any) -> bool:
    """The component takes the misbehaviour its point names (a decision, e.g. once per room)."""
    return True


def _crash(point: str) -> Effect:
    def crash(value: Any, firing: Firing, **_: Any) -> Any:
        firing.crash(point)
        return value  # only when the entry's crash action returns (it never does in a child)

    return crash


def _stall(value: Any, firing: Firing, **_: Any) -> float:
    """The seconds to wait before sending pages: a window for kills and aborts."""
    return firing.stall_s


def _write_sealed_page(pages: list[int], firing: Firing, *, n_hit: int, **_: Any) -> list[int]:
    """The bug: the new tokens' page-table entry names the last sealed page, so the forward
    overwrites KV that other requests read (I2). Needs a sealed page and a new one."""
    if 0 < n_hit < len(pages):
        pages = list(pages)
        pages[n_hit] = pages[n_hit - 1]
    return pages


def _rank_passes_all(flags: Any, firing: Firing, **_: Any) -> Any:
    """A rank skips its own ownership check: a tensor of fail flags comes back all clear, a list
    of owned flags all set."""
    if isinstance(flags, list):
        return [True] * len(flags)
    return flags.new_zeros(flags.shape)


def _drop_prompt_logprobs(first_logprobs: dict, firing: Firing, **_: Any) -> dict:
    """DONE's first-token entry without the prompt's logprobs (a prefill that lost them)."""
    return {k: v for k, v in first_logprobs.items() if k != "prompt"}


EFFECTS: dict[str, Effect] = {
    "corrupt_page": _fires,
    "truncate_transfer": _fires,
    "stall_transfer": _stall,
    "placeholder_on_reject": _fires,
    "late_write": _fires,
    "kill_prefill": _crash("kill_prefill"),
    "kill_decode": _crash("kill_decode"),
    "client_disconnect": _fires,
    "write_sealed_page": _write_sealed_page,
    "stale_cached_page": _fires,
    "tp_rank_skips_tag_check": _rank_passes_all,
    "tp_leader_decides_alone": _fires,
    "tp_corrupt_rank_slice": _fires,
    "drop_prompt_logprobs": _drop_prompt_logprobs,
}
