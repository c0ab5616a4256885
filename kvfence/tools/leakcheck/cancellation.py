"""Probe `cancellation`: streams cut before the first token or after a few chunks, each followed
at once by other tenants' requests that would show a cancelled request's pages."""

from __future__ import annotations

import asyncio

from kvfence.tools.leakcheck.run import Run


async def probe(run: Run, n: int) -> None:
    t = run.target
    assert t is not None
    ctx = t.context_length
    for x, y, _ in run.rounds(n):
        p = run.prompt(x, "cancellation", run.rng.randint(int(ctx * 0.2), int(ctx * 0.8)))
        cut = run.rng.choice([0, 1, 2, 5])
        if cut == 0:  # hang up before the answer starts (possibly mid-transfer)
            await run.send(
                "cancellation",
                "cut before first token",
                x,
                p,
                64,
                stream=True,
                cancel_after_s=run.rng.uniform(0.01, 0.2),
            )
        else:
            await run.send(
                "cancellation",
                f"cut after {cut} chunks",
                x,
                p,
                64,
                stream=True,
                cut_after=cut,
            )
        size = run.follow_up_size()
        await asyncio.gather(
            run.send(
                "cancellation",
                "bare cue after cut",
                y,
                run.prompt(y, "cancellation", size, records=False),
                32,
            ),
            run.send(
                "cancellation", "recall after cut", y, run.prompt(y, "cancellation", size), 32
            ),
        )
