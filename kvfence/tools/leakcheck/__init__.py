"""`kvfence leakcheck`: checks any OpenAI-compatible deployment from outside for KV leaks between
requests and tenants (canary cross-talk, admission edges, stale-page bait, cancellation) by
reading every answer, not only its status code, and for a prefix cache shared across tenants
(timing); exit 0 clean, 1 a finding, 2 could not run or INCOMPLETE.

One file per probe (`admission`, `crosstalk`, `stale_bait`, `cancellation`, `timing`); `run`
holds the shared plumbing, `budget` the order and shares, `cases` what ran and what did not,
`report` and `cli` the output and the flags."""

from kvfence.tools.leakcheck.api import Reply, api_root, context_length_of, pick_model
from kvfence.tools.leakcheck.cli import check, main, parse_args
from kvfence.tools.leakcheck.common import (
    EXIT_CANNOT_RUN,
    EXIT_CLEAN,
    EXIT_FAILED,
    PROBES,
    CannotRun,
    Settings,
    Tenant,
)
from kvfence.tools.leakcheck.judge import judge_status
from kvfence.tools.leakcheck.report import Report, Verdict, render_summary, verdict_of
from kvfence.tools.leakcheck.wording import count_from_error

__all__ = [
    "EXIT_CANNOT_RUN",
    "EXIT_CLEAN",
    "EXIT_FAILED",
    "PROBES",
    "CannotRun",
    "Reply",
    "Report",
    "Settings",
    "Tenant",
    "Verdict",
    "api_root",
    "check",
    "context_length_of",
    "count_from_error",
    "judge_status",
    "main",
    "parse_args",
    "pick_model",
    "render_summary",
    "verdict_of",
]
