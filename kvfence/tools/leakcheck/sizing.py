"""Sizing prompts by the server's own token counts: the tokenizer endpoint when the server has
one, else requests whose usage (or refusal) states the count. Over-length bait is never sized by
a guess alone: it is checked with the tokenizer, or grown until the server refuses it."""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.tools.canary import CanaryPrompt
from kvfence.tools.leakcheck.cases import Kind, State
from kvfence.tools.leakcheck.common import Tenant
from kvfence.tools.leakcheck.run import Run
from kvfence.tools.leakcheck.wording import parse_refusal

_MAX_FIT_STEPS = 6
_MAX_GROW_STEPS = 4


@dataclass(frozen=True)
class Measured:
    tokens: int
    source: str  # tokenizer | usage | refusal | refusal (at least)
    lower_bound: bool = False


async def measure(
    run: Run, probe: str, tenant: Tenant, p: CanaryPrompt, label: str
) -> Measured | None:
    t = run.target
    assert t is not None
    if t.tokenizer == "server":
        n = await run.api.tokenize(tenant, p.text)
        return Measured(n, "tokenizer") if n is not None else None
    # No tokenizer: a 1-token request tells (usage, or the count in its refusal), and is itself
    # an admission check of whatever length it turns out to have.
    out = await run.send(probe, f"measure {label}", tenant, p, 1, kind=Kind.STATUS)
    if out is None:
        return None
    r = out.reply
    if r.status == 200 and r.prompt_tokens is not None:
        return Measured(r.prompt_tokens, "usage")
    count = parse_refusal(r.error) if r.error else None
    if count is None:
        return None
    return Measured(
        count.tokens, "refusal (at least)" if count.lower_bound else "refusal", count.lower_bound
    )


async def fit(
    run: Run, probe: str, tenant: Tenant, target: int, label: str, *, over: bool = False
) -> tuple[CanaryPrompt, Measured | None]:
    """A prompt of exactly `target` server tokens when the server's counts allow it; the best
    one found (and its count, if known) otherwise."""
    t = run.target
    assert t is not None
    if t.tokenizer != "server" and target >= t.context_length:
        # A 1-token request of N tokens or more is refused, and many servers stop counting
        # past the limit ("at least N"): measure N-1 by usage, then add pad tokens (one
        # token each in common vocabularies). The send's own refusal or usage has the last word.
        base, m = await fit(run, probe, tenant, t.context_length - 1, f"{label} base")
        if m is None or m.lower_bound or m.tokens != t.context_length - 1:
            return base, m
        extra = round((target - m.tokens) / t.pad_rate)
        return base.padded(base.pad + extra, tokens=target), Measured(target, "fit")
    p = run.prompt(tenant, probe, target, over=over)
    m = None
    last: tuple[int, int] | None = None  # (pad, count) of the previous measurement
    for _ in range(_MAX_FIT_STEPS):
        m = await measure(run, probe, tenant, p, label)
        if m is None or m.tokens == target:
            return p, m
        if m.lower_bound:  # over the limit by an unknown amount: start again shorter
            p = run.prompt(tenant, probe, int(p.tokens * target / m.tokens) - 2)
            last = None
            continue
        if last is not None and last[0] != p.pad and last[1] != m.tokens:
            # Tokens per pad unit, as this server counts them (one in common vocabularies).
            t.pad_rate = max(0.05, (m.tokens - last[1]) / (p.pad - last[0]))
        last = (p.pad, m.tokens)
        pad = p.pad + round((target - m.tokens) / t.pad_rate)
        if pad < 0:  # too long even unpadded: rebuild shorter by the observed ratio
            p = run.prompt(tenant, probe, int(p.tokens * target / m.tokens) - 2)
            last = None
        else:
            if pad == p.pad:  # the rate rounds the step away: move by one unit
                pad += 1 if target > m.tokens else -1
            p = p.padded(pad)
    return p, m


async def send_over_length(
    run: Run, probe: str, case: str, tenant: Tenant, target: int, max_tokens: int
) -> None:
    """Send a prompt of at least `target` tokens (target > the context). With a tokenizer it is
    checked before it goes; without one it is sent, and while the server serves it within the
    context (usage says so) it grows and goes again: it is over-length only once that is known."""
    t = run.target
    assert t is not None
    ctx = t.context_length
    if t.tokenizer == "server":
        p, m = await fit(run, probe, tenant, target, case, over=True)
        if m is None or m.tokens + max_tokens <= ctx:
            run.cases.force(
                probe,
                case,
                Kind.STATUS,
                State.INCONCLUSIVE,
                f"could not build a prompt over the context with the server's tokenizer "
                f"(got {m.tokens if m else 'no count'} tokens for {target})",
            )
            return
        await run.send(
            probe,
            case,
            tenant,
            p,
            max_tokens,
            known_tokens=m.tokens,
            known_source="tokenizer",
            kind=Kind.STATUS,
        )
        return
    p = run.prompt(tenant, probe, target, over=True)
    for _ in range(_MAX_GROW_STEPS):
        out = await run.send(probe, case, tenant, p, max_tokens, kind=Kind.STATUS)
        if out is None:
            return
        r = out.reply
        served_legal = (
            r.status == 200 and r.prompt_tokens is not None and r.prompt_tokens + max_tokens <= ctx
        )
        if not served_legal:
            return  # refused, or served over the context (a wrong status), or unknown
        # Within the context after all: a legal request rightly served. Grow it and go again.
        p = p.padded(p.pad + target - r.prompt_tokens)
    run.cases.force(
        probe,
        case,
        Kind.STATUS,
        State.INCONCLUSIVE,
        f"the prompt was still within the context after {_MAX_GROW_STEPS} growths",
    )
