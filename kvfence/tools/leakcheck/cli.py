"""`kvfence leakcheck`'s command line: flags to `Settings`, `check` (one whole run, returns the
report) and `main` (prints the summary, writes the report, returns the exit code)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from kvfence.tools.leakcheck.api import Api, api_root
from kvfence.tools.leakcheck.budget import run_all
from kvfence.tools.leakcheck.common import (
    ALL_PROBES,
    EXIT_CANNOT_RUN,
    EXIT_FAILED,
    CannotRun,
    Settings,
    Tenant,
)
from kvfence.tools.leakcheck.report import Report, build_report, failed_report, render_summary
from kvfence.tools.leakcheck.run import Run


def _tenants(keys: Sequence[str], key_file: str | None) -> list[Tenant]:
    pairs: list[tuple[str, str | None]] = [(k, None) for k in keys]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            parts = line.split()
            if parts and not parts[0].startswith("#"):
                pairs.append((parts[0], parts[1] if len(parts) > 1 else None))
    out: list[Tenant] = []
    for i, (key, name) in enumerate(pairs):
        # Never the key itself: reports and logs get shared.
        out.append(Tenant(name or f"tenant{i + 1}", key))
    return out


def parse_args(argv: Sequence[str] | None) -> Settings:
    p = argparse.ArgumentParser(
        prog="kvfence leakcheck",
        description="Check an OpenAI-compatible deployment for KV-cache leaks between requests "
        "and tenants by reading the answers. Exit 0 clean; 1 only for what was seen: a leak, a "
        "status wrong on its face, or a prefix cache shared across tenants; 2 could not run, or "
        "INCOMPLETE (a check that was not left out could not be judged, --allow-incomplete "
        "makes that 0; or leakcheck itself failed, named in the summary).",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://vllm-host:8000 (or .../v1)")
    p.add_argument(
        "--api-key", action="append", default=[], help="repeat: each key is a tenant (2+ best)"
    )
    p.add_argument(
        "--api-key-file", default=None, help="lines of `key [tenant]` (keeps keys off ps)"
    )
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument(
        "--context-length", type=int, default=None, help="default: what /v1/models reports"
    )
    p.add_argument("--requests", type=int, default=200, help="total requests sent (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--duration", type=float, default=300.0, help="seconds at most (default 300)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per request")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("--seed", type=int, default=None, help="replay prompts and canaries exactly")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--probe",
        action="append",
        choices=ALL_PROBES,
        default=None,
        help="run only this probe (repeat for several); default: all of them (timing when two "
        "or more keys are given). The timing probe's INCONCLUSIVE (no prefix caching seen, or "
        "too little power) sets exit 2 only with --probe timing alone; in the default set it is "
        "reported and the exit code follows the other probes",
    )
    p.add_argument(
        "--skip-probe", action="append", choices=ALL_PROBES, default=[], help="leave a probe out"
    )
    p.add_argument(
        "--timing-prefix-tokens",
        type=int,
        default=None,
        help="timing probe: prefix length P (default: context/4, at least 1024, within context)",
    )
    p.add_argument(
        "--timing-pairs", type=int, default=40, help="timing probe: at most this many pairs per arm"
    )
    p.add_argument(
        "--cache-salt-field",
        default=None,
        help="timing probe: also check a per-request cache salt sent in this body field (e.g. "
        "cache_salt): one tenant with two salts, and two tenants with one salt, must not share",
    )
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="exit 0 (not 2) when the verdict is INCOMPLETE: some check that was not left out "
        "could not be judged (the summary and the report still say which and why)",
    )
    a = p.parse_args(argv)
    tenants = _tenants(a.api_key, a.api_key_file)
    if not tenants:
        p.error("give at least one --api-key (two or more to check between tenants)")
    for name, value in (("--requests", a.requests), ("--concurrency", a.concurrency)):
        if value < 1:
            p.error(f"{name} must be at least 1")
    if a.context_length is not None and a.context_length < 16:
        p.error("--context-length must be at least 16")
    return Settings(
        base_url=a.base_url,
        tenants=tuple(tenants),
        model=a.model,
        context_length=a.context_length,
        requests=a.requests,
        concurrency=a.concurrency,
        duration=a.duration,
        timeout=a.timeout,
        seed=a.seed,
        report=a.report,
        progress=not a.no_progress,
        probes=tuple(a.probe) if a.probe else None,
        skip_probes=tuple(a.skip_probe),
        allow_incomplete=a.allow_incomplete,
        timing_prefix_tokens=a.timing_prefix_tokens,
        timing_pairs=a.timing_pairs,
        cache_salt_field=a.cache_salt_field,
    )


async def check(
    settings: Settings,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    err: IO[str] | None = None,
) -> Report:
    """Run every probe against `settings.base_url`; returns the report (see `build_report`).
    Never raises for what a run or a server does: a failure of leakcheck itself becomes an
    INCOMPLETE report (exit 2) that names it, next to whatever the run had already seen."""
    started = time.monotonic()
    err = err if err is not None else sys.stderr
    run: Run | None = None
    cannot: str | None = None
    internal: str | None = None
    try:
        api = Api(api_root(settings.base_url), settings.timeout, transport)
    except CannotRun as e:
        return build_report(settings, None, started, str(e))
    try:
        run = Run(settings, api, err)
        await run_all(run)
    except CannotRun as e:
        cannot = str(e)
    except Exception as e:  # noqa: BLE001 - the verdict must survive leakcheck's own bugs
        internal = _internal(e)
    finally:
        if run is not None:
            run.progress.close()
        try:
            await api.close()
        except Exception as e:  # noqa: BLE001
            internal = internal or _internal(e)
    try:
        return build_report(settings, run, started, cannot, internal)
    except Exception as e:  # noqa: BLE001
        return failed_report(settings, started, f"internal error: {_internal(e)}")


def _internal(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    at = f" at {Path(where[0].filename).name}:{where[0].lineno}" if where else ""
    return f"{type(e).__name__}: {e}{at}"[:500]


def finish(report: Report, out: IO[str]) -> int:
    """Print the summary and write the JSON report; the exit code. A failure here is leakcheck's
    own: it exits 2 naming it, never 1 (which a cron job reads as a leak)."""
    code = report.exit_code
    try:
        out.write(render_summary(report) + "\n")
    except Exception as e:  # noqa: BLE001
        code = code if code == EXIT_FAILED else EXIT_CANNOT_RUN
        out.write(f"verdict: INCOMPLETE (exit {code}): internal error: {_internal(e)}\n")
    path = report.settings.report
    if path:
        try:
            Path(path).write_text(json.dumps(report.as_dict(), indent=2) + "\n")
            out.write(f"report: {path}\n")
        except Exception as e:  # noqa: BLE001
            code = code if code == EXIT_FAILED else EXIT_CANNOT_RUN
            out.write(f"report not written ({_internal(e)}): exit {code}\n")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    started = time.monotonic()
    try:
        report = asyncio.run(check(settings))
    except Exception as e:  # noqa: BLE001
        report = failed_report(settings, started, f"internal error: {_internal(e)}")
    return finish(report, sys.stdout)
