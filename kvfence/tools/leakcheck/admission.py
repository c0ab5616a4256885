"""Probe `admission`: requests at the context's edges (N-1, N, N+1 plain, chat and streamed,
2N, prompt + max_tokens = N+1), sized with the server's own token counts."""

from __future__ import annotations

from kvfence.tools.canary import CanaryPrompt
from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run
from kvfence.tools.leakcheck.wording import count_from_error

_MAX_FIT_STEPS = 5


async def measure(run: Run, tenant: Tenant, p: CanaryPrompt, label: str) -> int | None:
    t = run.target
    assert t is not None
    if t.tokenizer == "server":
        return await run.api.tokenize(tenant, p.text)
    # No tokenizer: a 1-token request tells (usage, or the count in its error), and is
    # itself an admission check of whatever length it turns out to have.
    out = await run.send("admission", f"measure {label}", tenant, p, 1)
    if out is None:
        return None
    r = out.reply
    if r.status == 200 and r.prompt_tokens is not None:
        return r.prompt_tokens
    if r.error:
        return count_from_error(r.error)
    return None


async def fit(run: Run, tenant: Tenant, target: int, label: str) -> tuple[CanaryPrompt, int | None]:
    """A prompt of exactly `target` server tokens when the server's counts allow it; the
    best one found (and its count, if known) otherwise."""
    p = run.prompt(tenant, "admission", target)
    n = None
    for _ in range(_MAX_FIT_STEPS):
        n = await measure(run, tenant, p, label)
        if n is None or n == target:
            return p, n
        pad = p.pad + (target - n)
        if pad < 0:  # too long even unpadded: rebuild shorter by the observed ratio
            p = run.prompt(tenant, "admission", int(p.tokens * target / n) - 2)
        else:
            p = p.padded(pad)
    return p, n


async def probe(run: Run) -> None:
    t = run.target
    assert t is not None
    n = t.context_length
    a = t.tenants[0]
    b = t.tenants[-1]
    p, c = await fit(run, a, n - 1, "N-1")
    if c is not None and c < n and t.tokenizer == "server":
        await run.send("admission", "N-1, max_tokens to N", a, p, n - c, known_tokens=c)
    p, c = await fit(run, b, n, "N")
    if c is not None:
        await run.send("admission", "N, default max_tokens", b, p, None, known_tokens=c)
    p, c = await fit(run, a, n + 1, "N+1")
    if c is not None:
        await run.send("admission", "N+1", a, p, 16, known_tokens=c)
        if t.chat:
            await run.send("admission", "N+1 chat", a, p, 16, chat=True)
        await run.send("admission", "N+1 stream", a, p, 16, stream=True, known_tokens=c)
    p = run.prompt(b, "admission", 2 * n)
    await run.send("admission", "2N", b, p, 16)
    p, c = await fit(run, a, max(8, n - 48), "N-48")
    if c is not None and c < n:
        await run.send("admission", "prompt + max_tokens = N+1", a, p, n - c + 1, known_tokens=c)
