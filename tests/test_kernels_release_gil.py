"""The native kernels release the GIL while they compute, as torch's own ops do.

Why it matters: `kvfence serve` runs the engine on a thread and the HTTP event loop on another.
A kernel that holds the GIL (the packed GEMM is about half of a step) freezes the loop for its
whole duration, so tokens already sampled wait to be streamed, and the threads fight over the
GIL at every op (py-spy --gil showed the engine holding it inside `packed_matmul`).

How it is checked without a clock threshold: with the switch interval made huge, a Python
thread can run only where the main thread lets go of the GIL by itself. A helper thread stamps
perf_counter_ns in a loop; the main thread stamps before and after a kernel call. Helper stamps
strictly inside that window prove Python ran during the call, which a GIL-holding kernel makes
(nearly) impossible, so it is asked of several calls, several stamps each. The probe's own twin
runs it over a call that never lets go of the GIL; against the kernels as built before this
change, the packed GEMM, decode and silu_mul checks fail.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvfence.model import kernels
from kvfence.model.linear import to_panels

ATTEMPTS = 60  # each call is tens of ms
WANTED = 5  # calls inside which the helper ran ...
PER_CALL = 3  # ... at least this many times (a held GIL lets in none, a stray one at most)


def python_ran_during(call: Callable[[], object], attempts: int = ATTEMPTS) -> bool:
    call()  # warm-up: the first call also starts thread pools and allocators
    stamps: list[int] = []
    stop = threading.Event()

    def helper() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter_ns())
            time.sleep(0)  # lets go of the GIL, so the main thread is never starved

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)  # no forced hand-over: only voluntary releases count
    t = threading.Thread(target=helper, daemon=True)
    t.start()
    try:
        hits = 0
        for _ in range(attempts):
            seen = len(stamps)
            t0 = time.perf_counter_ns()
            call()
            t1 = time.perf_counter_ns()
            hits += sum(t0 < s < t1 for s in stamps[seen:]) >= PER_CALL
            if hits >= WANTED:
                return True
            time.sleep(0)  # let the helper run between attempts
        return False
    finally:
        stop.set()
        sys.setswitchinterval(old)
        t.join(timeout=10)


def holds_the_gil(x: torch.Tensor) -> Callable[[], object]:
    """A call that keeps the GIL for a while: pure Python work over a tensor's size."""

    def call() -> object:
        total = 0
        for i in range(400_000):
            total += i
        return total + x.numel()

    return call


def test_the_probe_sees_a_call_that_holds_the_gil() -> None:
    # The twin of the checks below: the same probe over a call that never lets go of the GIL.
    assert not python_ran_during(holds_the_gil(torch.zeros(4)), attempts=20)


def test_packed_gemm_releases_the_gil() -> None:
    g = kernels.packed_gemm()
    assert g is not None, "the packed gemm kernel did not build; see the warning in the log"
    x, w_t = torch.randn(1024, 576), torch.randn(576, 3072)
    panels = to_panels(w_t, g.width)
    assert python_ran_during(lambda: g.matmul(x, panels, w_t.shape[1])), (
        "no Python ran while packed_matmul computed: it holds the GIL"
    )


def test_paged_decode_releases_the_gil() -> None:
    k = kernels.paged_decode()
    assert k is not None, "the native kernel did not build; see the warning in the log"
    page, pages, rows, ctx = 16, 4097, 32, 2048
    kc = torch.randn(pages * page, 2, 64)
    vc = torch.randn(pages * page, 2, 64)
    table = torch.arange(1, rows * (ctx // page) + 1).view(rows, -1) % (pages - 1) + 1
    q = torch.randn(rows, 8, 64)
    lens = torch.full((rows,), ctx, dtype=torch.int64)
    assert python_ran_during(lambda: k(q, kc, vc, table, lens, page, 0.125, 0)), (
        "no Python ran while paged_decode computed: it holds the GIL"
    )


def test_paged_prefill_releases_the_gil() -> None:
    k = kernels.paged_prefill()
    assert k is not None, "the native prefill kernel did not build; see the warning in the log"
    page, ctx, chunk = 16, 2048, 256
    kc = torch.randn((ctx // page + 1) * page, 2, 64)
    vc = torch.randn_like(kc)
    table = torch.arange(1, ctx // page + 1)[None, :]
    q, out = torch.randn(chunk, 8, 64), torch.empty(chunk, 8, 64)
    lens = [torch.tensor([n]) for n in (ctx, 0, chunk)]  # context, q start, q length
    assert python_ran_during(lambda: k(q, kc, vc, table, *lens, page, 0.125, 0, out)), (
        "no Python ran while paged_prefill computed: it holds the GIL"
    )


@pytest.mark.parametrize("op", ["add_rms_norm", "silu_mul"])
def test_fused_epilogue_releases_the_gil(op: str) -> None:
    f = kernels.fused_epilogue()
    assert f is not None, "the fused epilogue kernel did not build; see the warning in the log"
    x = torch.randn(8192, 1536)
    if op == "add_rms_norm":
        delta, weight = torch.randn(8192, 1536), torch.randn(1536)
        call: Callable[[], object] = lambda: f.add_rms_norm(x, delta, weight, 1e-6)  # noqa: E731
    else:
        call = lambda: f.silu_mul(x, 768)  # noqa: E731
    assert python_ran_during(call), f"no Python ran while {op} computed: it holds the GIL"
