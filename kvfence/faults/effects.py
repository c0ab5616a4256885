"""What each action point does when it fires: the one home of the bugs the twins plant.

Production code never branches on an action point; it passes a value through `Faults.hook` and
gets it back unchanged unless the point fires, in which case the effect registered here returns
the faulty value. An effect receives the value, the firing process's `Firing` (its stall time and
crash action) and the keyword context its hook line passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
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


def _hang_up(value: Any, firing: Firing, *, abort: Callable[[], None], **_: Any) -> Any:
    """The client goes away half a second after its RESERVE left: prefill is computing or
    sending by then (an IO loop's hook)."""
    asyncio.get_running_loop().call_later(0.5, abort)
    return value


def _scramble_cached_page(pages: list[int], firing: Firing, *, tensors: Any, **_: Any) -> Any:
    """The first cached prefix page's K/V change under a room whose RESERVE already went out
    (tensors: the pool's, as the pool port hands them out)."""
    if pages:
        slots = slice(pages[0] * tensors.page_size, (pages[0] + 1) * tensors.page_size)
        tensors.k[:, slots] *= -1
        tensors.v[:, slots] *= -16
    return pages


def _truncate(value: tuple, firing: Firing, *, page_size: int, skip: int, **_: Any) -> tuple:
    """Prefill sends only the first page (runs, tokens DONE reports, tokens sent), and a DONE
    that agrees with what it sent."""
    _, _, sent = value
    sent = min(sent, page_size)
    return [(0, 1, sent)], skip * page_size + sent, sent


def _placeholder(
    verdict: Any, firing: Firing, *, rejected: bool, request: Any, engine: Any, mode: Any, **_: Any
) -> Any:
    """The incident's engine bug: a RESERVE prefill rejected goes on as a 1-token stand-in that
    is computed and sent (what the client then gets is the twin's to show)."""
    if not rejected or request is None:
        return verdict
    one = replace(
        request,
        prompt_token_ids=request.prompt_token_ids[:1] or (0,),
        sampling=type(request.sampling)(max_tokens=1),
        cache_salt=None,
    )
    return engine.submit(one, lambda _out: None, mode)


def _rank_passes_all(flags: Any, firing: Firing, **_: Any) -> Any:
    """A rank skips its own ownership check: a tensor of fail flags comes back all clear, a list
    of owned flags all set."""
    if isinstance(flags, list):
        return [True] * len(flags)
    return flags.new_zeros(flags.shape)


def _drop_prompt_logprobs(first_logprobs: dict, firing: Firing, **_: Any) -> dict:
    """DONE's first-token entry without the prompt's logprobs (a prefill that lost them)."""
    return {k: v for k, v in first_logprobs.items() if k != "prompt"}


def _keep_last(seqs: list, firing: Firing, **_: Any) -> list:
    """The boot warm-up forgets its last row: its pages stay held by a grant nobody serves."""
    return seqs[:-1]


EFFECTS: dict[str, Effect] = {
    "corrupt_page": _fires,
    "truncate_transfer": _truncate,
    "stall_transfer": _stall,
    "placeholder_on_reject": _placeholder,
    "late_write": _fires,
    "kill_prefill": _crash("kill_prefill"),
    "kill_decode": _crash("kill_decode"),
    "client_disconnect": _hang_up,
    "write_sealed_page": _write_sealed_page,
    "stale_cached_page": _scramble_cached_page,
    "tp_rank_skips_tag_check": _rank_passes_all,
    "tp_leader_decides_alone": _fires,
    "tp_corrupt_rank_slice": _fires,
    "drop_prompt_logprobs": _drop_prompt_logprobs,
    "warmup_keeps_pages": _keep_last,
}
