"""What every part of `kvfence leakcheck` shares: exit codes, probe names, the run's settings and
its tenants, and the one exception that means "nothing about leaks is known"."""

from __future__ import annotations

from dataclasses import dataclass

EXIT_CLEAN = 0
EXIT_FAILED = 1  # a leak or a wrong status
EXIT_CANNOT_RUN = 2  # also INCOMPLETE: a check the user did not exclude could not be judged
REPORT_VERSION = 2
CANARY_PROBES = ("admission", "crosstalk", "stale_bait", "cancellation")
PROBES = ("setup", *CANARY_PROBES)
ALL_PROBES = (*CANARY_PROBES, "timing")
# Statuses that say nothing about the request's length: auth, rate limits, overload.
NOT_A_VERDICT = {401, 403, 408, 429}


class CannotRun(Exception):
    """The check could not be run at all (exit 2): nothing about leaks is known."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str


@dataclass(frozen=True)
class Settings:
    base_url: str
    tenants: tuple[Tenant, ...]
    model: str | None = None
    context_length: int | None = None
    requests: int = 200
    concurrency: int = 8
    duration: float = 300.0
    timeout: float = 180.0
    seed: int | None = None
    report: str | None = None
    progress: bool = True
    probes: tuple[str, ...] | None = None  # None: the default set
    skip_probes: tuple[str, ...] = ()
    allow_incomplete: bool = False  # INCOMPLETE exits 0 instead of 2 (still says INCOMPLETE)
    # The timing probe (prefix cache shared across tenants).
    timing_prefix_tokens: int | None = None  # P; default from the context length
    timing_pairs: int = 40  # at most this many pairs per arm
    timing_alpha: float = 0.01  # KS test level per arm
    timing_auc_floor: float = 0.6  # an arm shows hits when its AUC CI lies above this
    cache_salt_field: str | None = None  # e.g. "cache_salt": adds the salt arms
