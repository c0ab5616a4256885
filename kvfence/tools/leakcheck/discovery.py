"""The `setup` step of leakcheck: which keys work, which model and context length, which
endpoints (completions, chat, the tokenizer) the server offers; raises CannotRun when none."""

from __future__ import annotations

from typing import Any

import httpx

from kvfence.tools.leakcheck.api import CONTEXT_FIELDS, pick_model
from kvfence.tools.leakcheck.cases import Kind
from kvfence.tools.leakcheck.common import CannotRun, Tenant
from kvfence.tools.leakcheck.run import Run, Target


async def setup(run: Run) -> Target:
    s = run.s
    models_body: Any = None
    live: list[Tenant] = []
    unreachable: str | None = None
    for tenant in s.tenants:
        try:
            r = await run.api.models(tenant)
        except httpx.HTTPError as e:
            unreachable = f"{type(e).__name__}: {e}"
            break
        if r.status_code in (401, 403):
            run.notes.append(f"key of tenant {tenant.name} refused by /v1/models")
            continue
        live.append(tenant)
        if r.status_code == 200 and models_body is None:
            try:
                models_body = r.json()
            except ValueError:
                models_body = None
    if unreachable:
        raise CannotRun(f"{run.api.root} is unreachable: {unreachable}")
    if not live:
        raise CannotRun("every API key was refused (401/403): check --api-key")
    model, ctx = pick_model(models_body, s.model)
    if model is None:
        raise CannotRun("the server lists no model at /v1/models: pass --model")
    source = "server"
    if s.context_length is not None:
        if ctx is not None and ctx != s.context_length:
            run.notes.append(
                f"server reports context length {ctx}; checking the given {s.context_length}"
            )
        ctx, source = s.context_length, "flag"
    if ctx is None:
        raise CannotRun(
            "the server does not report a context length at /v1/models "
            f"({', '.join(CONTEXT_FIELDS)}): pass --context-length"
        )
    run.api.model = model
    run.target = t = Target(model, ctx, source, live)
    await _first_requests(run, t)
    return t


async def _first_requests(run: Run, t: Target) -> None:
    """One short request per key (drops refused keys, calibrates chars/token), then a
    chat request and the tokenizer endpoint to learn what the server offers."""
    ratios: list[float] = []
    tenants = list(t.tenants)
    t.tenants = []
    completions_missing = 0
    for tenant in tenants:
        p = run.prompt(tenant, "setup", min(96, t.context_length // 4))
        out = await run.send("setup", "first request", tenant, p, 16, kind=Kind.DISCOVER)
        if out is None:
            break
        status = out.reply.status
        if status in (401, 403):
            run.notes.append(f"key of tenant {tenant.name} refused: {out.reply.error}")
            continue
        if status in (404, 405):
            completions_missing += 1
        t.tenants.append(tenant)
        if out.reply.prompt_tokens and status == 200:
            ratios.append(len(p.text) / out.reply.prompt_tokens)
    if not t.tenants:
        raise CannotRun("every API key was refused (401/403): check --api-key")
    if completions_missing == len(t.tenants):
        t.completions = False
        run.notes.append("no /v1/completions here: every probe uses chat")
    if ratios:
        # Err low: a prompt meant to be legal must not come out over the context.
        t.chars_per_token = min(ratios) * 0.95
    p = run.prompt(t.tenants[0], "setup", min(96, t.context_length // 4))
    out = await run.send(
        "setup", "chat support", t.tenants[0], p, 16, chat=True, kind=Kind.DISCOVER
    )
    t.chat = out is not None and out.reply.status == 200
    if not t.chat:
        run.notes.append("chat completions unavailable: probes use completions only")
    if t.completions and await run.api.tokenize(t.tenants[0], "hello") is not None:
        t.tokenizer = "server"
    if len(t.tenants) == 1:
        run.notes.append(
            "one tenant: leaks are checked between requests (same_tenant_other_request)"
        )
