"""The order of leakcheck's probes and each one's share of `--requests`."""

from __future__ import annotations

from kvfence.tools.leakcheck import admission, cancellation, crosstalk, discovery, stale_bait
from kvfence.tools.leakcheck.run import Run


async def run_all(run: Run) -> None:
    """Setup, then every probe in turn, each within its share of the budget."""
    await discovery.setup(run)
    quota_admission = min(24, max(8, run.limit // 8))
    quota_stale = max(8, run.limit // 5)
    quota_cancel = max(6, run.limit // 8)
    before = run.left
    await admission.probe(run)
    spent = before - run.left
    if spent > quota_admission:
        run.notes.append(f"admission probe used {spent} requests")
    await crosstalk.probe(run, max(0, run.left - quota_stale - quota_cancel))
    await stale_bait.probe(run, max(0, run.left - quota_cancel))
    await cancellation.probe(run, run.left)
    if run.stopped_early:
        run.notes.append(f"stopped early: --{run.stopped_early} reached")
