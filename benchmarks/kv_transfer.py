"""KV transfer rate: a prompt's KV moved prefill -> decode by the tcp and mooncake backends (an
in-process 1P1D pair, real sockets), against raw loopback TCP moving the same bytes in the same
run, interleaved by repeat.

The transfer window is timed from prefill's SendPages (compute done, pages about to be read) to
the end of decode's DONE handling (counts, per-page checksums and the read-back digest checked),
so it holds everything the hand-off costs after compute: reads, hashing, MACs, frames, writes.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.common import (  # noqa: E402
    RESULTS,
    machine,
    new_figure,
    plot_available,
    random_prompts,
    this_command,
    write_json,
)


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


def pd_transfer(
    backend: str, model: str, prompt_len: int, repeats: int, ctx: int, pool: int, vocab: int
) -> list[dict]:
    from pd_harness import PDPair

    from kvfence.engine.request import SamplingParams
    from kvfence.pd import kvio

    pair = PDPair(model, timeout_s=120.0, backend=backend, context_length=ctx, kv_pool_tokens=pool)
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    send_pages = pair.prefill._send_pages
    on_done = pair.decode._on_done

    async def timed_send(rid: str, room) -> None:  # type: ignore[no-untyped-def]
        starts[rid] = time.perf_counter()
        await send_pages(rid, room)

    def timed_done(done) -> None:  # type: ignore[no-untyped-def]
        on_done(done)
        ends[done.room] = time.perf_counter()

    pair.prefill._send_pages = timed_send  # type: ignore[method-assign]
    pair.decode._on_done = timed_done  # type: ignore[method-assign]
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    try:
        nbytes = kvio.payload_size(pair.decode.engine.pool, prompt_len)
        for i, prompt in enumerate(random_prompts(repeats + 1, prompt_len, vocab, seed=7)):
            rid, res = pair.submit(prompt, sp)
            assert not isinstance(res, Exception) and res.done.wait(300), f"{backend}: no answer"
            assert res.final is not None and res.final.error is None, res.final
            if i == 0:
                continue  # warm-up: first connection, first allocation
            wall = ends[rid] - starts[rid]
            out.append({"bytes": nbytes, "seconds": wall, "bytes_per_s": nbytes / wall})
        assert pair.wait_idle(), "pages still held after the transfers"
    finally:
        pair.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(ROOT / "models" / "kvfence-tiny"))
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backends", default="tcp,mooncake")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="kv_transfer")
    a = p.parse_args(argv)
    out = Path(a.out)
    cmd = this_command()
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    ctx = max(4096, a.prompt_len + 16)
    backends = a.backends.split(",")
    skipped = {}
    if "mooncake" in backends:
        try:
            import mooncake.engine  # noqa: F401
        except Exception as e:  # noqa: BLE001 - optional backend
            skipped["mooncake"] = f"{type(e).__name__}: {e}"
            backends.remove("mooncake")
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    raw: list[float] = []
    nbytes = 0
    for b in backends:  # each pair keeps its engines: repeats interleave with the raw link
        rs = pd_transfer(b, a.model, a.prompt_len, a.repeats, ctx, 2 * ctx, int(cfg["vocab_size"]))
        runs[b] = rs
        nbytes = rs[0]["bytes"]
        page_bytes = nbytes * 16 // a.prompt_len
        for _ in rs:
            raw.append(raw_tcp_rate(nbytes, max(page_bytes, 4096)))
        med = sorted(r["bytes_per_s"] for r in rs)[len(rs) // 2]
        print(f"{b}: median {med / 1e6:.1f} MB/s over {len(rs)} transfers of {nbytes / 1e6:.1f} MB")
    raw_med = sorted(raw)[len(raw) // 2]
    print(f"raw loopback TCP: median {raw_med / 1e6:.1f} MB/s")
    summary = {}
    for b, rs in runs.items():
        med = sorted(r["bytes_per_s"] for r in rs)[len(rs) // 2]
        summary[b] = {"median_MBps": med / 1e6, "fraction_of_raw_tcp": med / raw_med}
    result = {
        "command": cmd,
        "machine": machine(),
        "model": a.model,
        "prompt_len": a.prompt_len,
        "kv_bytes": nbytes,
        "runs": runs,
        "raw_tcp_Bps": raw,
        "raw_tcp_median_MBps": raw_med / 1e6,
        "summary": summary,
        "skipped": skipped,
    }
    print(json.dumps(summary, indent=1))
    write_json(out / f"{a.name}.json", result)
    if plot_available():
        fig, ax = new_figure(figsize=(6, 4))
        names = [*runs, "raw loopback TCP"]
        vals = [summary[b]["median_MBps"] for b in runs] + [raw_med / 1e6]
        ax.bar(names, vals, color=["C0", "C1", "C7"][: len(names)])
        ax.set_ylabel("MB/s (median)")
        ax.set_title(f"KV of a {a.prompt_len}-token prompt ({nbytes / 1e6:.1f} MB)")
        fig.tight_layout()
        fig.savefig(out / f"{a.name}.png", dpi=110)
        print(f"wrote {out / f'{a.name}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
