"""Probe `admission`: requests at the context's edges (N-1, N, N+1 plain, chat and streamed,
2N, prompt + max_tokens = N+1), sized with the server's own token counts. Every case is a
status check: a case whose prompt could not be sized, or whose answer could not be judged,
shows as inconclusive or skipped, never as passed."""

from __future__ import annotations

from kvfence.tools.canary import CanaryPrompt
from kvfence.tools.leakcheck.cases import Kind, State
from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run
from kvfence.tools.leakcheck.sizing import Measured, fit, send_over_length

PROBE = "admission"
CASES = (
    "N-1, max_tokens to N",
    "N, default max_tokens",
    "N+1",
    "N+1 chat",
    "N+1 stream",
    "2N",
    "prompt + max_tokens = N+1",
)


def _unsized(run: Run, case: str, m: Measured | None, target: int) -> None:
    why = (
        f"no prompt of exactly {target} tokens could be built: the server's count was "
        f"{m.tokens} ({m.source})"
        if m is not None
        else f"the server gave no token count for a prompt of about {target} tokens "
        "(no tokenizer endpoint, no usage, and a refusal in a wording leakcheck does not know)"
    )
    run.cases.force(PROBE, case, Kind.STATUS, State.SKIPPED, why)


async def _sized(
    run: Run, tenant: Tenant, target: int, label: str, cases: tuple[str, ...]
) -> tuple[CanaryPrompt, Measured] | None:
    p, m = await fit(run, PROBE, tenant, target, label)
    if m is None or m.tokens != target or m.lower_bound:
        for case in cases:
            _unsized(run, case, m, target)
        return None
    return p, m


async def probe(run: Run) -> None:
    t = run.target
    assert t is not None
    n = t.context_length
    a = t.tenants[0]
    b = t.tenants[-1]
    for case in CASES:
        run.cases.plan(PROBE, case, Kind.STATUS)
    if not t.chat:
        run.cases.force(
            PROBE, "N+1 chat", Kind.STATUS, State.NOT_APPLICABLE, "no chat completions here"
        )
    got = await _sized(run, a, n - 1, "N-1", ("N-1, max_tokens to N",))
    if got:
        p, m = got
        await run.send(
            PROBE,
            "N-1, max_tokens to N",
            a,
            p,
            n - m.tokens,
            known_tokens=m.tokens,
            known_source=m.source,
            kind=Kind.STATUS,
        )
    got = await _sized(run, b, n, "N", ("N, default max_tokens",))
    if got:
        p, m = got
        await run.send(
            PROBE,
            "N, default max_tokens",
            b,
            p,
            None,
            known_tokens=m.tokens,
            known_source=m.source,
            kind=Kind.STATUS,
        )
    plus = ("N+1", "N+1 chat", "N+1 stream") if t.chat else ("N+1", "N+1 stream")
    got = await _sized(run, a, n + 1, "N+1", plus)
    if got:
        p, m = got
        await run.send(
            PROBE,
            "N+1",
            a,
            p,
            16,
            known_tokens=m.tokens,
            known_source=m.source,
            kind=Kind.STATUS,
        )
        if t.chat:
            # The chat template only adds tokens; the tokenizer (when there is one) counts
            # them, else the refusal has to.
            chat_n = None
            if t.tokenizer == "server":
                chat_n = await run.api.tokenize(a, p.text, chat=True)
            await run.send(
                PROBE,
                "N+1 chat",
                a,
                p,
                16,
                chat=True,
                kind=Kind.STATUS,
                known_tokens=chat_n,
                known_source="tokenizer",
                known_is_chat=True,
            )
        await run.send(
            PROBE,
            "N+1 stream",
            a,
            p,
            16,
            stream=True,
            known_tokens=m.tokens,
            known_source=m.source,
            kind=Kind.STATUS,
        )
    await send_over_length(run, PROBE, "2N", b, 2 * n, 16)
    got = await _sized(run, a, max(8, n - 48), "N-48", ("prompt + max_tokens = N+1",))
    if got:
        p, m = got
        await run.send(
            PROBE,
            "prompt + max_tokens = N+1",
            a,
            p,
            n - m.tokens + 1,
            known_tokens=m.tokens,
            known_source=m.source,
            kind=Kind.STATUS,
        )
