"""A child process that must not outlive its parent: Linux's parent-death signal.

`kvfence up` and a worker's HTTP process each own children (workers and router; the engine
process) that hold ports, pools and transfers. When the parent is SIGKILLed it cannot stop them,
so each child asks the kernel to SIGKILL it when its parent dies. A parent that wants this for a
child it execs names itself in DIE_WITH_ENV; the child's entry point calls
die_with_parent_from_env(), which also removes the variable so the child's own children (TP
ranks, the engine process) do not read their grandparent's pid as their parent's.
"""

from __future__ import annotations

import os
import signal
import sys

DIE_WITH_ENV = "KVFENCE_DIE_WITH_PID"


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when `parent` dies (at once if it already has). The signal follows
    the thread that forked this process: parents spawn such children from their main thread."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # it died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent_from_env() -> None:
    """die_with_parent(the pid in DIE_WITH_ENV), if the parent set one; consumes the variable."""
    pid = os.environ.pop(DIE_WITH_ENV, None)
    if pid:
        die_with_parent(int(pid))
