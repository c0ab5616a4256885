"""Fair share of the running set between tenants: which waiting sequence a free running slot
goes to. The scheduler asks `next_waiting` instead of taking the head of its queue."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol


class _Tenanted(Protocol):
    @property
    def tenant(self) -> str: ...


def next_waiting(
    waiting: Seq[_Tenanted],
    running: Iterable[_Tenanted],
    per_tenant_cap: int | None,
    fair: bool = True,
) -> int | None:
    """Index in `waiting` of the sequence to admit next, or None when every waiting tenant is at
    its cap. Each tenant's own sequences keep their order (only a tenant's first waiting one
    competes), and among tenants the one holding the fewest running slots wins, ties to the
    earlier arrival: so a tenant with many long streams cannot keep another tenant's request
    waiting for more than the next free slot, and with a cap not even that.
    fair=False is the old FIFO (the twin's guard off): the head, whatever its tenant holds."""
    if not waiting:
        return None
    if not fair:
        return 0
    held = Counter(s.tenant for s in running)
    best: int | None = None
    best_held = 0
    seen: set[str] = set()
    for i, seq in enumerate(waiting):
        tenant = seq.tenant
        if tenant in seen:
            continue
        seen.add(tenant)
        n = held[tenant]
        if per_tenant_cap is not None and n >= per_tenant_cap:
            continue
        if best is None or n < best_held:
            best, best_held = i, n
            if n == 0:
                break  # nobody can hold fewer, and this one arrived first among those
    return best
