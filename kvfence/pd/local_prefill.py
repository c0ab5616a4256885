"""Where a decode worker's next prompt is computed: by its prefill worker (the PD path) or here,
in this worker's own chunked steps beside its decodes (a unified request, no transfer).

Why: on a host whose cores the roles share, a prefill worker on its share of them is the
bottleneck of a prompt-heavy load while decode has time to spare (1P1D on 2 cores, 256 -> 64 at
C=8: TTFT p50 2.9 s, TPOT 40 ms; serve 0.76 s and 74 ms). A decode step has room for prefill
tokens beside its rows (the step-time budget, kvfence/engine/step_budget.py sizes them), so a
prompt that would queue behind many at the prefill worker is computed here instead, the way a
work-stealing scheduler balances two queues. Interleaved 1P1D A/B against the same tree without
it (benchmarks/pd_before_after.py, 256 -> 64, 3 pairs, 2 cores loaded by other work, so a
direction, not a figure): C=8, 16 prompts: TTFT p50 0.46x (0.40-0.51), throughput 1.04x
(1.03-1.29), ITL p50 1.24x, ITL p99 1.58x; C=32, 32 prompts: TTFT p50 0.90x (0.90-1.01),
throughput 1.04x (0.85-1.14), ITL p50 0.95x, ITL p99 1.02x.

The rule compares the prompt tokens each side has yet to compute for this worker's requests
(those not yet answered with a first token): here when

    (here + prompt) * factor < (there + prompt)

`factor` is how much slower a prompt goes through here than at a prefill worker: the decode
steps take a share of this worker's time, so 2 looks the fair price, but `kvfence up` asks 1
(queues kept even): interleaved 1P1D A/B on 2 loaded cores measured 1 ahead (256 -> 64, C=8,
16 prompts, 3 pairs each against no local prefill: TTFT p50 0.51x vs 0.60x, throughput 1.14x
vs 1.03x, ITL p50 1.09x vs 1.31x; a direction, not a figure). The view is this worker's own
requests: with several decodes per prefill it undercounts the prefill's queue, which only keeps
more prompts on the PD path. Its own prompts are bounded (LOCAL_LIMIT_CHUNKS), and a decode
that takes them keeps the narrow step target at any batch width (DecodeService): the wide one
lets a unified engine's queued prompts through a wide batch, which a decode's prompts need not,
having the prefill worker. Arithmetic and counters only (no clock, no engine).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A decode holds at most this many chunks (--chunked-prefill-size) of prompts of its own: its
# backlog floor (1/--prefill-backlog-steps of them a step) then stays near the minimum chunk,
# and a burst goes to the prefill worker. Unbounded (factor 1, 1P1D at C=32 on 2 cores), the
# local queue grew to thousands of tokens and its floor to 0.75 s steps: ITL p99 30x.
LOCAL_LIMIT_CHUNKS = 1
# `kvfence up`'s default: a prompt is computed here when the prefill worker's queue of this
# worker's prompts is the longer one (above: why not the fairer-looking 2).
UP_FACTOR = 1.0


def computes_here(here: int, there: int, prompt: int, factor: float, limit: int) -> bool:
    """Whether a prompt of `prompt` tokens goes faster through this worker's own steps, with
    `here` prompt tokens still to compute locally and `there` at the prefill worker, a local
    token costing `factor` remote ones; and fits under `limit` local tokens (one prompt always
    may). factor <= 0: never (the PD path only)."""
    if factor <= 0 or (here and here + prompt > limit):
        return False
    return (here + prompt) * factor < there + prompt


@dataclass
class PendingPrompts:
    """Prompt tokens of this worker's requests that have no first token yet, by where they are
    computed. Claimed on the submitting thread, settled on the engine's: hence the lock."""

    factor: float
    limit: int = 1 << 62  # local prompt tokens in flight at most (LOCAL_LIMIT_CHUNKS chunks)
    here: int = 0
    there: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def claim(self, prompt: int) -> bool:
        """Choose where a prompt goes and count it there; True: computed here."""
        with self._lock:
            local = computes_here(self.here, self.there, prompt, self.factor, self.limit)
            if local:
                self.here += prompt
            else:
                self.there += prompt
            return local

    def settle(self, local: bool, prompt: int) -> None:
        """The prompt is computed (its first token is out) or will never be (refused, failed)."""
        with self._lock:
            if local:
                self.here -= prompt
            else:
                self.there -= prompt

    def sink(self, local: bool, prompt: int, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """sink, settling the claim at its first output (a token, or the end of the request)."""
        settled = False

        def first_settles(out: Any) -> None:
            nonlocal settled
            if not settled:
                settled = True
                self.settle(local, prompt)
            sink(out)

        return first_settles
