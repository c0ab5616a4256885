"""Probe `stale_bait`: fills the cache with one tenant's canaries, then asks another tenant for
what only stale pages could answer (over-length, long, aborted prompts and bare cues)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable

from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run
from kvfence.tools.leakcheck.sizing import send_over_length


async def probe(run: Run, n: int) -> None:
    """Fill the cache with one tenant's canaries, then ask another for what only stale
    pages could answer: over-length prompts, long prompts a short prefill pool cannot
    hold (the incident), aborted ones, and bare cues that own no canary at all."""
    t = run.target
    assert t is not None
    ctx = t.context_length
    for a, b, unspent in run.rounds(n):

        def fill(_: int, a: Tenant = a) -> Awaitable[object]:
            # Log-uniform lengths: an unknown pool keeps only the prompts that fit it.
            size = int(math.exp(run.rng.uniform(math.log(ctx * 0.1), math.log(ctx * 0.9))))
            return run.send("stale_bait", "fill", a, run.prompt(a, "stale_bait", size), 16)

        await asyncio.gather(*(fill(i) for i in range(min(6, unspent))))

        def long_legal(b: Tenant = b) -> Awaitable[object]:
            size = run.rng.randint(int(ctx * 0.45), max(int(ctx * 0.45), ctx - 40))
            p = run.prompt(b, "stale_bait", size)
            return run.send("stale_bait", "long within context", b, p, 32)

        aborted = run.prompt(b, "stale_bait", run.rng.randint(int(ctx * 0.3), ctx - 40))
        await asyncio.gather(
            long_legal(),
            long_legal(),
            long_legal(),
            send_over_length(
                run, "stale_bait", "over-length", b, run.rng.choice([ctx + 16, int(ctx * 1.5)]), 32
            ),
            run.send(
                "stale_bait",
                "aborted long",
                b,
                aborted,
                32,
                stream=True,
                cut_after=run.rng.choice([1, 2]),
            ),
        )
        size = run.follow_up_size()
        bare = [run.prompt(b, "stale_bait", size, records=False) for _ in range(2)]
        own = run.prompt(a, "stale_bait", size)
        await asyncio.gather(
            *(run.send("stale_bait", "bare cue after bait", b, p, 32) for p in bare),
            run.send("stale_bait", "short after bait", a, own, 32),
        )
