"""Probe `crosstalk`: concurrent canary prompts from every tenant (completions and chat, some
streamed); any answer holding another request's canary is a leak."""

from __future__ import annotations

from kvfence.tools.leakcheck.run import Run


async def probe(run: Run, n: int) -> None:
    t = run.target
    assert t is not None
    hi = max(48, min(400, t.context_length // 2))

    async def one(i: int) -> None:
        tenant = t.tenants[i % len(t.tenants)]
        p = run.prompt(tenant, "crosstalk", run.rng.randint(min(48, hi), hi))
        chat = t.chat and i % 3 == 2
        await run.send("crosstalk", "canary recall", tenant, p, 24, chat=chat, stream=i % 5 == 4)

    await run.pool(n, one)
