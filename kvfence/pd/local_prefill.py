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

The rule compares when the prompt would get its first token on each side, from the prompt
tokens each has yet to compute for this worker's requests (those not yet answered with a first
token) and what a token costs each (LocalPace): here when

    (here + prompt) * here_ms * factor < (there + prompt) * there_ms

here_ms is a token's share of this worker's steps at the prefill budget its time target gives
them beside its decode rows (fit on its own steps: kvfence/engine/step_budget.py), there_ms a
token of the prefill worker's whole-chunk steps (the same model on the same share of cores
under `kvfence up`). The backlog floor is off at such a decode (LOCAL_BACKLOG_STEPS): it grows
with the local queue, so its steps would outgrow the price (and priced, it would send more
prompts here the longer the queue: the runaway a fixed bound used to stop). Priced, the local
queue needs no bound: it stays as long as its wait is no worse. Before the cost is fit, a local
token costs `factor` remote ones and at most LOCAL_LIMIT_CHUNKS chunks wait here.

Why priced and unbounded: with the bound of one chunk, a burst (a closed loop's first C
prompts) left the decode worker two of them at C=32 and the prefill worker thirty: 1P1D /
serve goodput at 2 s x 100 ms 0.12x on EPYC (benchmarks/RESULTS.md "Goodput against vLLM at its
defaults"; a step log of a loaded 1P1D run showed the same, the decode decoding 2-4 rows in
50-70 ms steps while the prefill worker's queue took 36 s). The model of the two workers
(benchmarks/pd_local_sim.py, step costs scaled to EPYC's serve throughput) put the priced rule
at 0.77-0.88x of serve's goodput at C=32 (0.91-0.94x with the backlog floor on, whose steps
made ITL p99 4-5x on loaded cores) against 0.51-0.78x with the bound, C=8 unchanged
(0.88-0.90x). Measured 1P1D against the bounded rule in one tree (benchmarks/goodput.py, 32
fresh prompts, 3 alternating pairs on 2 cores at load 2-5, so a direction): C=32 throughput
0.89-1.30x, TTFT p50 0.61-0.82x, ITL p99 3.8-5x (the decode's 2x-target steps beside ~25 rows),
C=8 equal; no 1P1D run met TPOT 100 ms at C=32 on cores that loaded.

With a TPOT target such a decode prices its prompts, and runs its steps, within that target's
step, its floors held within two (step_budget.held_to_tpot): in 1P1D at C=32 the floors made
150-650 ms steps beside 5-28 rows, every stream's TPOT 150-260 ms at a 50 ms target, while the
local prompts were late anyway. The prefill worker and this queue then serve the prompts that
can still meet the TTFT target first (Scheduler.share_prompts). Interleaved on 2 loaded cores
(diag, one pass each, a direction): C=32 fp32 TPOT 36-90 ms against 80-410, C=8 bf16 goodput
unchanged (1.41, 1.47 against 1.34-1.48 req/s at 2 s x 100 ms).

`factor` scales the local side: `kvfence up` asks UP_FACTOR (below), and while no stream
decodes here IDLE_FACTOR stands in for it (a local prompt then delays nobody). The view is this
worker's own requests: with several decodes per prefill it undercounts the prefill's queue,
which only keeps more prompts on the PD path. A decode that takes prompts keeps the narrow step
target at any batch width (DecodeService): the wide one lets a unified engine's queued prompts
through a wide batch, which a decode's prompts need not, having the prefill worker. Arithmetic
and counters only (no clock, no engine).

BORROWING: `kvfence up` gives each worker its share of the host's cores (1P1D on 2 cores: one
thread each), so that the prefill's and the decode's parallel regions never wait on each
other's descheduled threads. But in a closed loop the two mostly take turns: a wave's prompts
are computed (on both workers: the burst is split, IDLE_FACTOR), then its streams decode while
the prefill worker has nothing of this worker's to do and its core idles. So while no prompt
of this worker's is at the prefill worker, the decode's steps run on the prefill worker's
threads too (--decode-borrow-threads; `up` lends its share to the decode of a 1P1D pair, where
this worker's prompts are all the prefill worker's work). A bf16 8-row decode step on EPYC takes
22.5 ms on one thread and 18.8 on two. The count is set before each step, so a prompt sent to
the prefill worker shares a core with the decode for one step at most. Interleaved A/B (bf16
C=8, 256 -> 64, 3 pairs of 2 passes): 2 s x 100 ms 2.69-3.11 req/s against 2.60-2.88; 5 quiet
passes: 1P1D / serve goodput at 2 s x 100 ms 0.92x, 0.83x before (benchmarks/RESULTS.md
"Goodput against vLLM at its defaults").
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvfence.engine.request import RequestOutput
from kvfence.engine.step_budget import StepCost

# Before its step cost is fit, a decode holds at most this many chunks (--chunked-prefill-size)
# of prompts of its own: compared by tokens alone (factor 1, 1P1D at C=32 on 2 cores), the local
# queue grew to thousands of tokens and its backlog floor to 0.75 s steps: ITL p99 30x.
LOCAL_LIMIT_CHUNKS = 1
# A decode that takes prompts computes them at its time target, the pace they are priced at:
# it has no backlog floor (--prefill-backlog-steps 0), so a long local queue never lengthens
# its steps (at 16, the default, a C=32 burst's local queue of ~3,300 tokens made
# 500-750 ms steps on 2 loaded cores: ITL p99 4-5x the bounded rule's).
LOCAL_BACKLOG_STEPS = 0
# `kvfence up`'s default: a prompt is computed here when its first token comes three times
# sooner here. A local prompt's tokens ride in the steps of every stream this worker decodes,
# which the price (its own first token) leaves out; at 1 the decode worker, the one the
# streams wait on, took a third of a closed loop's prompts while the prefill worker idled half
# the time (1P1D bf16, C=8, 256 -> 64 on EPYC: decode 97% busy, prefill ~50%; TPOT 35 ms).
# At 3 (goodput.py's client, one pass per factor, 2 cores, a direction): bf16 C=8 throughput
# 931-999 tok/s against 875-906 at 1 and 894-915 at 0, TPOT 22 ms, 2 s x 100 ms goodput
# 2.85-2.99 req/s against 2.73-2.83; C=32 1.56 against 1.49; fp32 C=8 1.29 against 1.52 and
# C=32 0.14 against 0.23, each still above serve's (0.3 and 0 at that cell).
UP_FACTOR = 3.0
# With no stream decoding here a local prompt delays none, so the factor that stands for them
# (UP_FACTOR's "every stream waits through its tokens") is off: the prompt goes where its first
# token comes first, and a burst into an idle pair is split between the two workers. At
# UP_FACTOR throughout, a closed loop's first C=8 prompts left the decode worker one of them and
# the prefill worker's single core the rest: the wave's last first tokens at 2.2-2.9 s, three
# of 48 requests past 2 s in every pass (1P1D bf16, 256 -> 64 on EPYC). Interleaved A/B
# (diag through goodput.py's client, 3 pairs of 2 passes, 2 s x 100 ms): 2.88-3.03 req/s
# against 2.47-2.73, TTFT p50 855-972 ms against 1,132-1,317, throughput 922-971 tok/s
# against 843-910, every first token of the burst within 1.8 s.
IDLE_FACTOR = 1.0


@dataclass(frozen=True)
class LocalPace:
    """What a prompt token costs each side, in ms of its worker's time: here, in this worker's
    steps at the prefill budget it now gives them beside its decode rows; there, in the prefill
    worker's whole-chunk steps."""

    here_ms: float
    there_ms: float

    @staticmethod
    def of(cost: StepCost, decode_rows: int, budget: int, chunk: int) -> LocalPace:
        """From this worker's fitted step cost: a step of `decode_rows` rows computes `budget`
        prompt tokens in cost(budget, rows) ms; the prefill worker runs the same model on the
        same share of cores (`kvfence up`), a step of `chunk` tokens and no rows."""
        budget, chunk = max(1, budget), max(1, chunk)
        return LocalPace(
            cost.predict(budget, decode_rows) / budget, cost.predict(chunk, 0) / chunk
        )


def computes_here(
    here: int, there: int, prompt: int, factor: float, limit: int, pace: LocalPace | None = None
) -> bool:
    """Whether a prompt of `prompt` tokens gets its first token sooner from this worker's own
    steps, with `here` prompt tokens still to compute locally and `there` at the prefill worker;
    with a pace each side's tokens cost its ms per token, a local one `factor` times that, and
    the local queue needs no bound (its wait is priced); without one (nothing measured yet) a
    local token costs `factor` remote ones and at most `limit` local tokens wait (one prompt
    always may). factor <= 0: never (the PD path only)."""
    if factor <= 0:
        return False
    if pace is not None:
        return (here + prompt) * pace.here_ms * factor < (there + prompt) * pace.there_ms
    if here and here + prompt > limit:
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
    remote: int = 0  # prompts counted in `there`: each holds a decode row once its KV is in
    streams: int = 0  # this worker's requests past their first output and not yet finished

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def claim(self, prompt: int, price: Callable[[int], LocalPace | None] | None = None) -> bool:
        """Choose where a prompt goes and count it there; True: computed here. price(remote):
        the pace with `remote` prompts awaiting their KV from the prefill worker (None: not
        priced): a burst's claims come faster than steps, so the rows they will decode are
        counted as they are claimed, not at the last step."""
        with self._lock:
            pace = price(self.remote) if price is not None else None
            factor = self.factor if self.streams else min(self.factor, IDLE_FACTOR)
            local = computes_here(self.here, self.there, prompt, factor, self.limit, pace)
            if local:
                self.here += prompt
            else:
                self.there += prompt
                self.remote += 1
            return local

    def step_threads(self, own: int, borrow: int) -> int:
        """The CPU threads of this worker's next step: its `own`, and `borrow` more while none
        of its prompts is at the prefill worker (BORROWING above)."""
        return own if self.remote else own + borrow

    def settle(self, local: bool, prompt: int) -> None:
        """The prompt is computed (its first token is out) or will never be (refused, failed)."""
        with self._lock:
            if local:
                self.here -= prompt
            else:
                self.there -= prompt
                self.remote -= 1

    def sink(
        self, local: bool, prompt: int, sink: Callable[[RequestOutput], None]
    ) -> Callable[[RequestOutput], None]:
        """sink, settling the claim at its first output (a token, or the end of the request)
        and counting the request among the streams from then until its final output (I5: there
        is exactly one)."""
        settled = False

        def first_settles(out: RequestOutput) -> None:
            nonlocal settled
            if not settled:
                settled = True
                self.settle(local, prompt)
                if not out.finished:
                    self._stream(1)
            elif out.finished:
                self._stream(-1)
            sink(out)

        return first_settles

    def _stream(self, delta: int) -> None:
        with self._lock:
            self.streams += delta
