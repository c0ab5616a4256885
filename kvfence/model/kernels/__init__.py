"""Native CPU kernels, built on first use with torch's C++ extension loader (g++ and ninja).

- paged_decode.cpp: decode attention read in place from the paged KV pool.
- paged_prefill.cpp: prefill-chunk attention (causal, behind any cached prefix), read the same way.
- packed_gemm.cpp: `x @ W` with W packed in column panels: float32 (every float32 projection on
  CPU), and bfloat16 on the host's bf16 dot products (`has_bf16_dot()`).
- fused_epilogue.cpp: residual add + RMSNorm, silu(gate) * up, and rope + K/V cache write, one
  call each, over float32 or bfloat16 rows (float32 maths).
- claim.h: how the threads share a kernel's work (each its own share, then the others' rest).

Building is best effort: a host without a compiler gets None from `paged_decode()`,
`paged_prefill()`, `packed_gemm()` and `fused_epilogue()`, and the engine keeps its pure-torch
path, which gives the same results (to float rounding), only slower.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvfence import env

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
# The headers the kernels include (vec16.h by every one): part of each build's key.
HEADERS = tuple(sorted(HERE.glob("*.h")))
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]


def build_name(stem: str) -> str:
    """The extension's name for `<stem>.cpp`: its build directory under torch's cache."""
    src = HERE / f"{stem}.cpp"
    # -march=native: the build is cached per host CPU (the name carries the CPU model and the
    # source hash), so a shared cache directory never hands one CPU another's binary. The
    # source's path is in the name too: ninja rebuilds when a build line changes, so two
    # checkouts sharing one name would rebuild each other's kernel at every start.
    key = src.read_bytes() + b"".join(h.read_bytes() for h in HEADERS) + str(src).encode()
    key += platform.machine().encode()
    key += _cpu_id()
    return f"kvfence_{stem}_{hashlib.sha256(key).hexdigest()[:12]}"


@cache
def _build(stem: str) -> object | None:
    """The extension module compiled from `<stem>.cpp`, or None when it cannot be built here (the
    reason is logged once)."""
    name = build_name(stem)
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        build_dir = Path(_get_build_directory(name, verbose=False))
        with _builder_lock(build_dir):
            return load(
                name=name,
                sources=[str(HERE / f"{stem}.cpp")],
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                verbose=env.kernel_verbose(),
            )
    except Exception as e:  # no compiler, no ninja, a broken toolchain: fall back, say why
        log.warning("native kernel %s unavailable (%s); using the torch path", stem, e)
        return None


def paged_decode(widened: bool = False) -> Callable | None:
    """The compiled `paged_decode(q, k_cache, v_cache, page_table, ctx_lens, page_size, scale,
    window)`, or None when it cannot be built here. `widened`: as paged_prefill's."""
    mod = _build("paged_decode")
    if mod is None:
        return None
    return mod.paged_decode_widened if widened else mod.paged_decode  # type: ignore[attr-defined]


def paged_prefill(widened: bool = False) -> Callable | None:
    """The compiled `paged_prefill(q, k_cache, v_cache, page_table, ctx_lens, q_starts, q_lens,
    page_size, scale, window, out)`, or None when it cannot be built here. `widened`: the path
    that widens bf16 to float32 for every product, which hosts without bf16 dot products take
    (for tests and benchmarks that compare the two)."""
    mod = _build("paged_prefill")
    if mod is None:
        return None
    return mod.paged_prefill_widened if widened else mod.paged_prefill  # type: ignore[attr-defined]


def has_bf16_dot() -> bool:
    """Whether bf16 attention here runs on the host's bf16 dot products (-march=native defines
    __AVX512BF16__ where the CPU has avx512_bf16); without them both paths are the widening one."""
    return b"avx512_bf16" in _cpu_id()

def packed_gemm() -> PackedGemm | None:
    """The compiled `packed_matmul(x, panels, n, bias=None)` and its panel width, or None."""
    mod = _build("packed_gemm")
    if mod is None:
        return None
    return PackedGemm(
        mod.packed_matmul,  # type: ignore[attr-defined]
        mod.packed_panel_width(),  # type: ignore[attr-defined]
        mod.packed_has_bf16(),  # type: ignore[attr-defined]
    )


def packed_gemm_bf16() -> PackedGemm | None:
    """The packed GEMM where it runs bfloat16 here (a host with bf16 dot products), or None:
    bf16 projections then take oneDNN (CausalLM.prepack_onednn)."""
    gemm = packed_gemm() if has_bf16_dot() else None
    return gemm if gemm is not None and gemm.bf16 else None


@dataclass(frozen=True)
class PackedGemm:
    # (x [M, K] contiguous, panels, n, bias [n] | None) -> x @ W + bias [M, n], x's dtype.
    # float32: panels [P, K, width]; bfloat16: [P, ceil(K / 2), width, 2] (linear.to_panels).
    matmul: Callable
    width: int  # columns per panel
    bf16: bool  # whether the bfloat16 path is compiled in (the host has bf16 dot products)


def fused_epilogue() -> FusedEpilogue | None:
    """The compiled `add_rms_norm`, `silu_mul` and `rope_store` (float32 or bfloat16), or None."""
    mod = _build("fused_epilogue")
    if mod is None:
        return None
    return FusedEpilogue(
        mod.add_rms_norm, mod.silu_mul, mod.rope_store  # type: ignore[attr-defined]
    )


@dataclass(frozen=True)
class FusedEpilogue:
    # (x [M, N], delta [M, N] | None, weight [N], eps) -> rmsnorm(x + delta) * weight [M, N];
    # x becomes x + delta in place. Float32 or bfloat16 (weight in x's dtype), contiguous.
    add_rms_norm: Callable
    silu_mul: Callable  # (gate_up [M, 2n], n) -> silu(gate_up[:, :n]) * gate_up[:, n:] [M, n]
    # (qkv [T, (H + 2 KVH) D], cos, sin [T, 1, D], H, k_cache, v_cache [slots, KVH, D],
    # slot_mapping [T]) -> rotated q [T, H, D]; rotated k and v are written to the caches' rows
    # slot_mapping, no others. qkv and caches float32 or bfloat16, cos/sin float32, contiguous.
    rope_store: Callable


@contextmanager
def _builder_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock on the build directory while torch builds or loads into it. torch's own
    lock is a plain file that every other process waits on forever, and a build killed midway
    (a test, or an operator stopping a cluster while a worker compiles) leaves it behind. The
    flock dies with its holder, so while it is held no other process is inside torch's build
    here, and a torch lock file found then is a dead build's: it goes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "kvfence.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits only on a live process's build
        try:
            with suppress(FileNotFoundError):
                (build_dir / "lock").unlink()
                log.warning("removed a dead kernel build's lock in %s", build_dir)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cpu_id() -> bytes:
    """The first CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    except OSError:
        return b""
    return "\n".join(x for x in lines if x.startswith(("model name", "flags"))).encode()
