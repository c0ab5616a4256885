"""The thread that builds an engine gives back its OpenMP workers when the engine's own thread
takes over (`kvfence/engine/openmp.py` says why: with them left idle, every parallel region of
the engine thread waited for a wake-up, a third of a batch-1 decode step on 2 cores).

Checked by thread ids, not by time: in a fresh interpreter, the workers a parallel region on the
main thread starts (one more than the model's load left) are new entries of /proc/self/task
(torch may start an idle helper thread or two beside them); after `Engine.start` the workers
must be gone. A control run starts the engine with the release turned off and sees none go.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/task")

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from kvfence.engine import engine as engine_mod
    from kvfence.engine.llm import LLM

    def tids():
        return set(os.listdir("/proc/self/task"))

    llm = LLM(sys.argv[1], kv_pool_tokens=1024)  # may leave this thread a pool already
    before = tids()
    torch.set_num_threads(3)  # so the next region starts workers of its own, even on 1 core
    torch.zeros(1 << 22).add_(1.0)  # far above ATen's grain: a parallel region on this thread
    workers = tids() - before
    if sys.argv[2] == "off":
        engine_mod.release_thread_pool = lambda: False
    llm.engine.start()
    print(json.dumps({"started": sorted(workers), "gone": sorted(workers - tids())}))
    llm.engine.shutdown()
    """
)


def probe(model_dir: str, release: str, script: str = PROBE) -> dict:
    """Run a probe script in a fresh interpreter; its last line of output, as JSON."""
    out = subprocess.run(
        [sys.executable, "-c", script, model_dir, release],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_thread_pool_ends_the_calling_threads_workers() -> None:
    script = textwrap.dedent(
        """
        import os, torch
        from kvfence.engine.openmp import release_thread_pool
        torch.set_num_threads(2)
        before = set(os.listdir("/proc/self/task"))
        torch.zeros(1 << 22).add_(1.0)
        workers = set(os.listdir("/proc/self/task")) - before
        released = release_thread_pool()
        print(len(workers), released, len(workers - set(os.listdir("/proc/self/task"))))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    started, released, gone = out.stdout.split()
    assert int(started) >= 1, "the parallel region started no worker: nothing was checked"
    assert released == "True", "torch's libgomp (omp_pause_resource_all) was not found"
    assert int(gone) >= 1


def test_engine_start_gives_back_the_builders_openmp_workers(checkpoint_dir) -> None:
    seen = probe(str(checkpoint_dir("llama")), "on")
    assert seen["started"], "the parallel region started no worker: nothing was checked"
    assert seen["gone"], f"the main thread's OpenMP workers outlived Engine.start: {seen}"


def test_control_without_the_release_the_workers_stay(checkpoint_dir) -> None:
    seen = probe(str(checkpoint_dir("llama")), "off")
    assert seen["started"] and seen["gone"] == []


# An engine whose queue runs dry gives back the workers its steps started: left spinning, they
# take a core from the server's other threads (a PD transfer of the step's KV first of all).
# A prefill step that hands its sequence to the PD sender gives them back before the hand-off.
IDLE_PROBE = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch
    from kvfence.config import EngineConfig
    from kvfence.engine import engine as engine_mod
    from kvfence.engine.engine import Engine
    from kvfence.engine.request import GenerateRequest, SamplingParams
    from kvfence.engine.sequence import SeqMode

    def tids():
        return set(os.listdir("/proc/self/task"))

    if sys.argv[2] == "off":
        engine_mod.release_thread_pool = lambda: False
    calls, idle_after_handoff = [], threading.Event()

    class Hooks:
        def on_prefilled(self, seq):
            calls.append("handoff")
        def on_reserved(self, seq):
            raise AssertionError("prefill only")
        def on_abort(self, seq):
            pass

    # 3 threads: the step's parallel regions start workers of their own, even on 1 core.
    engine = Engine(EngineConfig(model=sys.argv[1], kv_pool_tokens=1024, threads=3), hooks=Hooks())
    go_idle = engine._go_idle
    def watched_go_idle():
        go_idle()
        calls.append("idle")
        if "handoff" in calls:
            idle_after_handoff.set()
    engine._go_idle = watched_go_idle
    during = set()
    run = engine.runner.run
    def watched_run(chunks):
        out = run(chunks)
        during.update(tids())  # the step's workers, just out of its last parallel region
        calls.append("step")
        return out
    engine.runner.run = watched_run
    engine.start()
    before = tids()
    prompt = tuple(i % 250 + 1 for i in range(300))
    req = GenerateRequest("r1", "t", prompt, SamplingParams(max_tokens=1))
    outs = []
    verdict = engine.submit(req, outs.append, SeqMode.PREFILL_ONLY)
    if not idle_after_handoff.wait(120):
        raise AssertionError(f"no idle engine after a hand-off: {verdict} {outs} {calls[:4]}")
    started = sorted(during - before)
    at_idle = sorted(set(started) & tids())
    # Exiting workers leave /proc/self/task shortly after the release returns: bounded wait.
    deadline = time.monotonic() + 60
    left = at_idle
    while sys.argv[2] == "on" and left and time.monotonic() < deadline:
        idle_after_handoff.wait(0.01)
        left = sorted(set(started) & tids())
    step = calls.index("step")
    seen = {"calls": calls[step : step + 3], "started": started, "at_idle": at_idle}
    print(json.dumps({**seen, "left": left}))
    engine.shutdown()
    """
)


def test_an_idle_engine_gives_back_its_steps_openmp_workers(checkpoint_dir) -> None:
    seen = probe(str(checkpoint_dir("llama")), "on", IDLE_PROBE)
    assert seen["started"], "the step started no OpenMP worker: nothing was checked"
    # A prefill step's release comes before its hand-off, not after the transfer started.
    assert seen["calls"] == ["step", "idle", "handoff"], seen
    assert seen["left"] == [], f"the step's OpenMP workers outlived the idle engine: {seen}"


def test_control_an_idle_engine_without_the_release_keeps_them_spinning(checkpoint_dir) -> None:
    seen = probe(str(checkpoint_dir("llama")), "off", IDLE_PROBE)
    assert seen["started"], "the step started no OpenMP worker: nothing was checked"
    assert seen["at_idle"] == seen["started"], seen
