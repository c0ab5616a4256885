"""The OpenMP runtime's worker pool of a thread: give back the one a thread that will compute no
more holds (the thread that loaded the model, before the engine's own thread takes over).

Why: GNU OpenMP keeps a pool of workers per thread that ever opened a parallel region, and when
its workers outnumber the cores it stops spinning between regions (`gomp_throttled_spin_count`):
every later region then waits for a futex wake-up. A server loads the model on its main thread
and steps on the engine's, so the main thread's idle pool made every parallel region of the
engine thread pay that wake-up: measured on 2 cores (benchmarks/RESULTS.md "HTTP: TTFT and
ITL"), a `torch.zeros` of 1 MiB took 78 us instead of 12, a batch-1 decode step 36 ms instead of 23.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: threads go, the runtime can start them again
MAPS = "/proc/self/maps"


@functools.cache
def _pause_all() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the GNU OpenMP library this process loaded (torch's own copy
    in its wheel first, should another copy be mapped too), or None: not Linux, or no libgomp
    loaded. Only libgomp: its pause releases the calling thread's pool alone; LLVM's runtime
    would stop every thread's."""
    try:
        with open(MAPS) as f:
            mapped = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    paths = [p for p in mapped if os.path.basename(p).startswith("libgomp")]
    for path in sorted(paths, key=lambda p: ("/torch/" not in p, p)):
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


def release_thread_pool() -> bool:
    """Let the calling thread's OpenMP workers exit (a later parallel region on this thread
    starts them again). Call it on a thread that has finished computing; True if released."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
