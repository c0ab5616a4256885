"""Every `KVFENCE_*` environment variable kvfence reads, typed, in one place.

Each is read when its function is called, never at import, so a test harness can set one after
kvfence is imported and a child process sees what its parent passed it.
"""

from __future__ import annotations

import os

FAULT_INJECTION = "KVFENCE_FAULT_INJECTION"  # "1": fault points may be armed (tests only)
FAULTS = "KVFENCE_FAULTS"  # comma-separated fault points a child process arms at start
FAULT_RATE = "KVFENCE_FAULT_RATE"  # probability an armed point fires per check (chaos soak)
FAULT_SEED = "KVFENCE_FAULT_SEED"  # seed of that draw, so a soak's faults can be replayed
STALL_S = "KVFENCE_STALL_S"  # seconds the stall_transfer fault waits
TLS_DIR = "KVFENCE_TLS_DIR"  # PD TLS files (ca.crt, ROLE.crt, ROLE.key) when no --tls-* flags
ADMIN_API_KEY = "KVFENCE_ADMIN_API_KEY"  # the operator key when no --admin-api-key-file
KERNEL_VERBOSE = "KVFENCE_KERNEL_VERBOSE"  # "1": show the native kernels' compiler output


class EnvError(ValueError):
    """A KVFENCE_* variable holds a value of the wrong type."""


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r}: expected a number") from None


def fault_injection() -> bool:
    return os.environ.get(FAULT_INJECTION) == "1"


def faults() -> tuple[str, ...]:
    return tuple(name for name in os.environ.get(FAULTS, "").split(",") if name)


def fault_rate() -> float:
    return _float(FAULT_RATE, 1.0)


def fault_seed() -> int | None:
    raw = os.environ.get(FAULT_SEED, "")
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{FAULT_SEED}={raw!r}: expected an integer") from None


def stall_s() -> float:
    return _float(STALL_S, 3.0)


def tls_dir() -> str | None:
    return os.environ.get(TLS_DIR) or None


def kernel_verbose() -> bool:
    return os.environ.get(KERNEL_VERBOSE) == "1"


def admin_api_key() -> str | None:
    return os.environ.get(ADMIN_API_KEY) or None
