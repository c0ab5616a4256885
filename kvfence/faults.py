"""Named fault points that switch a guard off, for the tests that prove each guard matters.

A point fires only when the process was started with KVFENCE_FAULT_INJECTION=1 AND a harness
armed it in-process; nothing reachable from HTTP can arm one.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "KVFENCE_FAULT_INJECTION"
POINTS = frozenset(
    {
        "skip_admission",  # admit() lets everything in (I1)
        "skip_tag_check",  # the runner's page-ownership check passes everything (I2)
        "skip_dest_check",  # decode writes a transfer's pages whatever grant/tenant owns them (I2)
        "corrupt_page",  # prefill flips a byte of a page after checksumming it (I3)
        "truncate_transfer",  # prefill sends only the first page, and a DONE that agrees (I3)
        "stall_transfer",  # prefill waits STALL_S before sending pages: a window for kills/aborts
        "placeholder_on_reject",  # the incident: prefill swaps a request it rejected for a 1-token
        #                           placeholder that continues through compute and transfer (I1)
        "skip_count_check",  # decode commits whatever counts DONE reports (I3)
        "skip_checksum",  # decode ignores page checksums and the read-back digest (I3)
        "early_release",  # decode frees a room's pages on abort without waiting for the fence (I4)
        "drop_abort_ack",  # prefill never acknowledges an ABORT (I4, liveness)
        "late_write",  # prefill keeps sending a room's pages after it acknowledged the abort (I4)
        "kill_prefill",  # the prefill process dies right after sending a room's first page
        "kill_decode",  # the decode process dies right after applying a room's first page
        "client_disconnect",  # decode's client goes away right after its RESERVE was sent
        "skip_mac",  # transfer connections accept frames whatever their MAC and sequence (I8)
        "tenant_from_header",  # the HTTP layer believes an X-Tenant header (I6)
        "skip_pairing_check",  # prefill and decode pair whatever facts they exchanged (I7)
    }
)
STALL_S = float(os.environ.get("KVFENCE_STALL_S", "3.0"))
# Chaos: env-armed points fire at each check with this probability instead of always.
_RATE = float(os.environ.get("KVFENCE_FAULT_RATE", "1.0"))

_armed: set[str] = set()
_random = random.Random()


def active(point: str) -> bool:
    if not _armed or point not in _armed:
        return False
    return _RATE >= 1.0 or _random.random() < _RATE


def arm(point: str) -> None:
    if os.environ.get(ENV) != "1":
        raise RuntimeError(f"fault injection is disabled; set {ENV}=1 in a test harness")
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    _armed.add(point)


def disarm(point: str) -> None:
    _armed.discard(point)


def arm_from_env() -> None:
    """Arm the points named in KVFENCE_FAULTS (comma-separated) for a test's child process."""
    for name in os.environ.get("KVFENCE_FAULTS", "").split(","):
        if name:
            arm(name)


@contextmanager
def injected(point: str) -> Iterator[None]:
    arm(point)
    try:
        yield
    finally:
        disarm(point)
