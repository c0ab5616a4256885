"""Where `kvfence serve`'s CPU goes under vLLM's client: one `vllm bench serve` run (after a short
warm-up), the server's threads read from /proc before and after it.

Printed per run: the engine thread (the busiest: the step loop's Python and the OpenMP master),
the HTTP event loop (the process's main thread: SSE, JSON, sockets), the rest of the process
(OpenMP workers, executor threads, threads that exited), and the client's own CPU (start-up
included). On a 2-core host every CPU-second outside the engine's OpenMP team is taken from it.
`--py-spy PATH` records the server with py-spy (non-blocking, idle samples kept) for a
per-function breakdown.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import bench_model, kvfence_server, shape_ctx  # noqa: E402
from benchmarks.goodput import client_command  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> tuple[float, dict[int, float]]:
    """(the process's CPU seconds, each live thread's), user + system."""

    def secs(stat: str) -> float:
        f = stat.rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / TICK

    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            threads[int(tid)] = secs(Path(f"/proc/{pid}/task/{tid}/stat").read_text())
        except OSError:
            continue  # exited meanwhile: counted in the process's total
    return secs(Path(f"/proc/{pid}/stat").read_text()), threads


def client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None, help="default: the SmolLM-135M-shaped checkpoint")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    p.add_argument("--kv-pool-tokens", type=int, default=65536)
    p.add_argument("--kvfence-args", default="", help="more flags for kvfence serve")
    p.add_argument("--py-spy", default=None, help="record the run into this raw-format file")
    a = p.parse_args(argv)
    model = bench_model(a.model, a.tiny)
    work = Path(tempfile.mkdtemp(prefix="kvfence-serve-cpu-"))
    extra = ["--dtype", a.dtype, "--served-model-name", "bench", *a.kvfence_args.split()]
    srv = kvfence_server("serve", model, shape_ctx(model), a.kv_pool_tokens, work / "serve.log",
                         extra=extra)
    try:
        srv.wait_ready()
        pid = srv.proc.pid
        warm = argparse.Namespace(**{**vars(a), "num_prompts": min(8, a.num_prompts)})
        subprocess.run(client_command(a.vllm_python, srv.url, model, warm, 8, 99, work / "w.json"),
                       check=True, stdout=subprocess.DEVNULL)
        spy = None
        if a.py_spy:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--nonblocking",
                                    "--idle", "--threads", "-f", "raw", "-o", a.py_spy])
        t0, (p0, th0), c0 = time.monotonic(), thread_cpu(pid), client_cpu()
        subprocess.run(client_command(a.vllm_python, srv.url, model, a, a.concurrency, 1,
                                      work / "run.json"), check=True, stdout=subprocess.DEVNULL)
        wall, (p1, th1), c1 = time.monotonic() - t0, thread_cpu(pid), client_cpu()
        if spy is not None:
            spy.send_signal(2)
            spy.wait(timeout=60)
    finally:
        srv.stop()
    used = {t: s - th0.get(t, 0.0) for t, s in th1.items()}
    engine = max((t for t in used if t != pid), key=used.__getitem__)
    rest = (p1 - p0) - used[engine] - used.get(pid, 0.0)
    print(f"C={a.concurrency}, {a.num_prompts} x {a.input_len} -> {a.output_len}: {wall:.1f} s "
          "(client start-up included)")
    for name, s in (("engine thread", used[engine]), ("HTTP event loop (main thread)",
                    used.get(pid, 0.0)), ("rest of the server (OpenMP workers, executors)", rest),
                    ("client (vllm bench serve)", c1 - c0)):
        print(f"  {name:48s} {s:7.1f} CPU s  {100 * s / wall:5.1f}% of one core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
