"""A child that must not outlive its parent (kvfence/lifetime.py): when the parent is SIGKILLed,
the kernel kills a child that armed the parent-death signal, and only such a child."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from procs import running
from waiting import poll

from kvfence.lifetime import DIE_WITH_ENV

CHILD = (
    "from kvfence.lifetime import die_with_parent_from_env; import os, time; "
    "die_with_parent_from_env(); "
    f"print('armed', os.getpid(), os.environ.get({DIE_WITH_ENV!r}), flush=True); time.sleep(600)"
)
# The parent starts the child (with DIE_WITH_ENV naming itself when asked), then waits forever.
PARENT = (
    "import os, subprocess, sys, time; "
    "env = dict(os.environ); "
    f"env.update({{{DIE_WITH_ENV!r}: str(os.getpid())}} if sys.argv[1] == 'arm' else {{}}); "
    f"subprocess.Popen([sys.executable, '-c', {CHILD!r}], env=env); time.sleep(600)"
)


def orphan_after_parent_sigkill(arm: bool, within: float) -> tuple[int, str, bool]:
    """(child pid, what the child saw in DIE_WITH_ENV, whether it was gone within `within` s of
    its parent's SIGKILL). A child still running at the end is killed here."""
    env = {k: v for k, v in os.environ.items() if k != DIE_WITH_ENV}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, "arm" if arm else "plain"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert parent.stdout is not None
        words = parent.stdout.readline().split()  # the child's line: it armed (or did not)
        assert words[:1] == ["armed"], f"child did not start: {words}"
        child = int(words[1])
        parent.kill()
        parent.wait(timeout=30)
        gone = poll(lambda: not running(child), timeout=within, interval=0.05)
        if not gone:
            os.kill(child, signal.SIGKILL)
        return child, words[2], gone
    finally:
        parent.kill()
        parent.wait(timeout=30)


def test_a_child_that_armed_the_signal_dies_with_its_sigkilled_parent() -> None:
    _, seen, gone = orphan_after_parent_sigkill(arm=True, within=15)
    assert gone, "the child outlived its SIGKILLed parent"
    assert seen == "None", "the variable is consumed: the child's own children must not see it"


def test_control_a_child_that_did_not_arm_it_outlives_its_parent() -> None:
    """The check above can fail: without the parent's pid in the environment nothing is armed,
    and the wait sees the orphan still running. (The kernel signals an armed child as its parent
    exits, before the parent can be reaped, so a few seconds are plenty to tell the two apart.)"""
    _, _, gone = orphan_after_parent_sigkill(arm=False, within=3)
    assert not gone, "an unarmed child died with its parent: the test above proves nothing"
