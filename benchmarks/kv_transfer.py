"""KV transfer rate: a prompt's KV moved prefill -> decode by the tcp and mooncake backends,
against raw loopback TCP moving the same bytes in the same run, interleaved by repeat, in two
modes:

- two-process (the headline; what deployments run): `kvfence serve --disaggregation-mode
  prefill` and `... decode` as two OS processes; the raw link is a sink process fed by this one.
- one-process: an in-process 1P1D pair (tests/pd_harness.PDPair, real sockets; both sides share
  one GIL); the raw link is a sink thread.

Two processes also time the same bytes over a bare TLS 1.3 channel between two processes
(tls_transfer.Sink: the same certificates and ssl settings as the workers): the most any
transfer that authenticates and encrypts its bytes (I8) can reach here, whatever else it checks.

The transfer window is timed from prefill's SendPages (compute done, pages about to be read) to
the end of decode's DONE handling (counts, per-page checksums and the read-back digest checked),
so it holds everything the hand-off costs after compute: reads, hashing, MACs, frames, writes.
Two processes: both ends are the workers' own CLOCK_MONOTONIC marks (pd/stats.py, in /pd/info's
transfer_marks: prefill's send_start, decode's done_handled).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    machine,
    new_figure,
    plot_available,
    random_prompts,
    save_figure,
    this_command,
    write_json,
)
from benchmarks.pd_workers import PDWorkers  # noqa: E402


def raw_tcp_rate(total: int, frame: int) -> float:
    """Bytes/s of one loopback TCP connection carrying `total` bytes in `frame`-sized sends."""
    payload = b"\x5a" * frame
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    got = [0]

    def sink() -> None:
        conn, _ = srv.accept()
        with conn:
            while got[0] < total:
                chunk = conn.recv(1 << 20)
                if not chunk:
                    break
                got[0] += len(chunk)

    t = threading.Thread(target=sink)
    t.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        start = time.perf_counter()
        sent = 0
        while sent < total:
            c.sendall(payload)
            sent += frame
        t.join()
        wall = time.perf_counter() - start
    srv.close()
    return got[0] / wall


# A sink process for the two-process raw link: per connection, an 8-byte length and an 8-byte
# frame size (0), then that many bytes read into a reused 1 MiB buffer, then a 1-byte ack; a zero
# length ends it.
_SINK = r"""
import socket, sys
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
buf = bytearray(1 << 20)
fbuf = memoryview(bytearray(0))
while True:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    head = conn.recv(16, socket.MSG_WAITALL)
    total, frame = int.from_bytes(head[:8], "big"), int.from_bytes(head[8:], "big")
    if not total:
        break
    got = 0
    while got < total:
        n = conn.recv_into(buf)
        if not n:
            break
        got += n
    conn.sendall(b"k")
    conn.close()
"""


class RawSink:
    """Raw loopback TCP into another process: the two-process baseline."""

    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", _SINK],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.p.stdout is not None
        self.port = int(self.p.stdout.readline())

    def rate(self, total: int, frame: int) -> float:
        """Bytes/s of `total` bytes in `frame`-sized sends."""
        payload = memoryview(b"\x5a" * frame)
        with socket.create_connection(("127.0.0.1", self.port)) as c:
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            start = time.perf_counter()
            c.sendall(total.to_bytes(8, "big") + (0).to_bytes(8, "big"))
            sent = 0
            while sent < total:
                part = payload[: min(frame, total - sent)]
                c.sendall(part)
                sent += part.nbytes
            assert c.recv(1) == b"k"
            wall = time.perf_counter() - start
        return total / wall

    def close(self) -> None:
        with socket.create_connection(("127.0.0.1", self.port)) as c:
            c.sendall((0).to_bytes(16, "big"))
        self.p.wait(10)


class Timed:
    """A 1P1D pair whose transfer windows are timed: from prefill's SendPages to the end of
    decode's DONE handling (the end is stamped on decode's loop, which may run after the client
    already saw the answer: wait for it)."""

    def __init__(self, backend: str, model: str, ctx: int, pool: int) -> None:
        from pd_harness import PDPair

        self.name = self.backend = backend
        self.pair = PDPair(
            model, timeout_s=120.0, backend=backend, context_length=ctx, kv_pool_tokens=pool
        )
        self.starts: dict[str, float] = {}
        self.ends: dict[str, float] = {}
        send_pages = self.pair.prefill.sender.send
        on_done = self.pair.decode._on_done

        async def timed_send(rid: str, room) -> None:  # type: ignore[no-untyped-def]
            self.starts[rid] = time.perf_counter()
            await send_pages(rid, room)

        def timed_done(done) -> None:  # type: ignore[no-untyped-def]
            on_done(done)
            self.ends[done.room] = time.perf_counter()

        self.pair.prefill.sender.send = timed_send  # type: ignore[method-assign]
        self.pair.decode._on_done = timed_done  # type: ignore[method-assign]

    def transfer(self, prompt: list[int]) -> float:
        from kvfence.engine.request import SamplingParams

        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        rid, res = self.pair.submit(prompt, sp)
        assert not isinstance(res, Exception) and res.done.wait(300), f"{self.backend}: no answer"
        assert res.final is not None and res.final.error is None, res.final
        deadline = time.monotonic() + 10
        while rid not in self.ends:
            assert time.monotonic() < deadline, "DONE handling never finished"
            time.sleep(0.001)
        return self.ends[rid] - self.starts[rid]

    def close(self) -> None:
        assert self.pair.wait_idle(), "pages still held after the transfers"
        self.pair.close()


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def run_mode(
    mode: str,
    backends: list[str],
    a: argparse.Namespace,
    prompts: list[list[int]],
    warmup: int,
    nbytes: int,
    page_bytes: int,
    out: Path,
) -> dict:
    """Interleaved by repeat: each backend once, then the raw link with the same bytes in frames
    of the size the tcp backend sends (kvio.RUN_BYTES) and in page-sized sends."""
    from kvfence.pd import kvio

    ctx = max(4096, a.prompt_len + 16)
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    raw: list[float] = []
    raw_page: list[float] = []
    raw_tls: list[float] = []  # two processes: the same bytes over bare TLS 1.3 (I8's channel)
    commands: list[list[str]] = []
    if mode == "two-process":
        from tls_transfer import Sink

        from kvfence.pd import certs

        cert_dir = certs.cluster(Path(tempfile.mkdtemp(prefix="kvfence-kv-transfer-")))
        sides = [
            PDWorkers(
                b, a.model, ctx, 2 * ctx, out / f"kv_transfer-{b}",
                {"KVFENCE_TLS_DIR": str(cert_dir)},
                args=["--disaggregation-transfer-backend", b],
            )  # fmt: skip
            for b in backends
        ]
        sink = RawSink()
        tls_sink = Sink(cert_dir, tls=True)
        commands = [c for w in sides for c in w.commands]
        rate = sink.rate
    else:
        sides = [Timed(b, a.model, ctx, 2 * ctx) for b in backends]  # type: ignore[misc]
        rate = raw_tcp_rate
    try:
        for i, prompt in enumerate(prompts):
            for t in sides:
                wall = t.transfer(prompt)
                if i >= warmup:
                    runs[t.name].append(
                        {"bytes": nbytes, "seconds": wall, "bytes_per_s": nbytes / wall}
                    )
            if i >= warmup:
                raw.append(rate(nbytes, min(kvio.RUN_BYTES, nbytes)))
                raw_page.append(rate(nbytes, page_bytes))
                if mode == "two-process":
                    raw_tls.append(tls_sink.rate(nbytes, min(kvio.RUN_BYTES, nbytes)))
    finally:
        for t in sides:
            t.close()
        if mode == "two-process":
            sink.close()
            tls_sink.close()
    raw_med, raw_page_med = _median(raw), _median(raw_page)
    # The link is whichever send size moved the bytes faster: the stricter baseline.
    link = max(raw_med, raw_page_med)
    print(
        f"[{mode}] raw loopback TCP: median {raw_med / 1e6:.1f} MB/s "
        f"({kvio.RUN_BYTES >> 20} MiB sends), {raw_page_med / 1e6:.1f} MB/s "
        f"({page_bytes >> 10} KiB sends)"
    )
    summary = {}
    tls_med = _median(raw_tls) if raw_tls else None
    if tls_med is not None:
        # What any transfer that MACs its bytes (I8) can reach here, whatever else it does.
        print(
            f"[{mode}] bare TLS 1.3 between two processes: median {tls_med / 1e6:.1f} MB/s "
            f"= {tls_med / link:.2f} of raw"
        )
    for b, rs in runs.items():
        med = _median([r["bytes_per_s"] for r in rs])
        summary[b] = {"median_MBps": med / 1e6, "fraction_of_raw_tcp": med / link}
        if tls_med is not None:
            summary[b]["fraction_of_bare_tls"] = med / tls_med
        print(
            f"[{mode}] {b}: median {med / 1e6:.1f} MB/s over {len(rs)} transfers of "
            f"{nbytes / 1e6:.1f} MB = {med / link:.2f} of raw"
        )
    return {
        "worker_commands": commands,
        "runs": runs,
        "raw_tcp_Bps": raw,
        "raw_tcp_median_MBps": raw_med / 1e6,
        "raw_tcp_send_bytes": kvio.RUN_BYTES,
        "raw_tcp_page_sends_Bps": raw_page,
        "raw_tcp_page_sends_median_MBps": raw_page_med / 1e6,
        "raw_tcp_link_MBps": link / 1e6,
        "bare_tls_Bps": raw_tls,
        "bare_tls_median_MBps": tls_med / 1e6 if tls_med is not None else None,
        "bare_tls_fraction_of_raw": tls_med / link if tls_med is not None else None,
        "summary": summary,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(ROOT / "models" / "kvfence-tiny"))
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="tcp,mooncake")
    p.add_argument("--modes", default="two-process,one-process")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="kv_transfer")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = this_command()
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    backends = a.backends.split(",")
    modes = a.modes.split(",")
    assert set(modes) <= {"two-process", "one-process"}, modes
    skipped = {}
    if "mooncake" in backends:
        try:
            import mooncake.engine  # noqa: F401
        except Exception as e:  # noqa: BLE001 - optional backend
            skipped["mooncake"] = f"{type(e).__name__}: {e}"
            backends.remove("mooncake")
    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine
    from kvfence.pd import kvio

    ctx = max(4096, a.prompt_len + 16)
    # The pool geometry every worker of this run has (an engine that is built, never started).
    pool = Engine(EngineConfig(model=a.model, context_length=ctx, kv_pool_tokens=2 * ctx)).pool
    nbytes = kvio.payload_size(pool, a.prompt_len)
    page_bytes = kvio.payload_size(pool, pool.page_size)
    # Warm-up: enough transfers for the decode pool to hand out every page once. A fresh pool is
    # untouched memory (torch.empty) whose first writes page-fault; a serving node's is not.
    warmup = max(1, -(-pool.num_pages // -(-a.prompt_len // pool.page_size)))
    del pool
    prompts = random_prompts(a.repeats + warmup, a.prompt_len, int(cfg["vocab_size"]), seed=7)
    result: dict = {
        "command": cmd,
        "machine": machine(),
        "model": a.model,
        "prompt_len": a.prompt_len,
        "kv_bytes": nbytes,
        "modes": {},
        "skipped": skipped,
    }
    for mode in modes:
        result["modes"][mode] = run_mode(
            mode, backends, a, prompts, warmup, nbytes, page_bytes, out
        )
    # Headline: the first mode run (two-process unless --modes says otherwise).
    head = result["modes"][modes[0]]
    result.update(
        {
            k: head[k]
            for k in (
                "summary",
                "raw_tcp_link_MBps",
                "raw_tcp_median_MBps",
                "bare_tls_median_MBps",
                "bare_tls_fraction_of_raw",
            )
        },
        headline_mode=modes[0],
    )
    result["machine"] = machine()  # the load average at the end of the run
    print(json.dumps({m: r["summary"] for m, r in result["modes"].items()}, indent=1))
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        fig, ax = new_figure(figsize=(7, 4))
        width = 0.8 / len(modes)
        names = [*backends, "raw loopback TCP", "bare TLS 1.3 (I8)"]
        for j, mode in enumerate(modes):
            r = result["modes"][mode]
            vals = [r["summary"][b]["median_MBps"] for b in backends] + [
                r["raw_tcp_link_MBps"],
                r["bare_tls_median_MBps"] or 0.0,
            ]
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, vals, width=width, label=mode, color=f"C{j}")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("MB/s (median)")
        ax.set_title(f"KV of a {a.prompt_len}-token prompt ({nbytes / 1e6:.1f} MB)")
        ax.legend()
        save_figure(fig, out / f"{a.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
