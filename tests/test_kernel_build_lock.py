"""A kernel build killed midway leaves torch's lock file behind, and torch waits on that file
forever: a worker started next (a restarted cluster, the next test) hung at "1 CPU thread(s) per
worker". The build now runs under an flock that dies with its holder, so a lock file found while
holding it is a dead build's and goes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfence.model import kernels

REPO = Path(__file__).resolve().parent.parent
DEAD = "a killed build's lock (tests/test_kernel_build_lock.py)"
BUILD_S = 900  # a cold build on a loaded 2-core host takes minutes; a hang never ends


def test_a_dead_builds_lock_does_not_hang_the_next_load():
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    if kernels.paged_decode() is None:
        pytest.skip("no native kernels on this host (no compiler)")
    build_dir = Path(cpp_extension._get_build_directory(kernels.build_name("paged_decode"), False))
    lock = build_dir / "lock"
    # What a build killed a moment ago leaves: a lock file (marked, so a live build's own lock,
    # which torch creates anew and empty, is never taken for it: another test's process may be
    # loading this kernel right now, under the flock, with its lock file in place).
    lock.write_text(DEAD)
    code = "from kvfence.model import kernels; assert kernels.paged_decode() is not None"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=BUILD_S)
    except subprocess.TimeoutExpired:
        lock.unlink(missing_ok=True)
        pytest.fail(f"loading the kernel waited {BUILD_S} s on a dead build's lock file")
    assert not _is_dead(lock), "the dead build's lock file is still there"


def _is_dead(lock: Path) -> bool:
    try:
        return lock.read_text() == DEAD
    except FileNotFoundError:
        return False
