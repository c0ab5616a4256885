"""Native CPU kernels, built on first use with torch's C++ extension loader (g++ and ninja).

Building is best effort: a host without a compiler gets None from `paged_decode()` and the
engine keeps its pure-torch attention path, which gives the same results, only slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent


@cache
def paged_decode() -> Callable | None:
    """The compiled `paged_decode(q, k_cache, v_cache, page_table, ctx_lens, page_size, scale,
    window)`, or None when it cannot be built here (the reason is logged once)."""
    src = HERE / "paged_decode.cpp"
    # -march=native: the build is cached per host CPU (the name carries the CPU model and the
    # source hash), so a shared cache directory never hands one CPU another's binary.
    tag = hashlib.sha256(src.read_bytes() + platform.machine().encode() + _cpu_id()).hexdigest()
    name = f"kvfence_paged_decode_{tag[:12]}"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        _drop_stale_lock(Path(_get_build_directory(name, verbose=False)) / "lock")
        mod = load(
            name=name,
            sources=[str(src)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=os.environ.get("KVFENCE_KERNEL_VERBOSE") == "1",
        )
    except Exception as e:  # no compiler, no ninja, a broken toolchain: fall back, say why
        log.warning("native paged decode kernel unavailable (%s); using torch attention", e)
        return None
    return mod.paged_decode


def _drop_stale_lock(lock: Path, max_age_s: float = 300.0) -> None:
    """torch's build lock is a plain file that every other process waits on forever; a build
    killed midway (a test or an operator stopping a cluster) would leave it behind."""
    try:
        if time.time() - lock.stat().st_mtime > max_age_s:
            lock.unlink()
            log.warning("removed a stale kernel build lock %s", lock)
    except FileNotFoundError:
        pass


def _cpu_id() -> bytes:
    """The first CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return b""
    return "\n".join(x for x in lines if x.startswith(("model name", "flags"))).encode()

