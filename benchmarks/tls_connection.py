"""The tcp transport's own cost, without the workers around it: kvfence's Connection
(pd/transport/tcp.py) on both ends, in two processes, moving what one 2,048-token kvfence-tiny
prompt's KV is (8 MiB as eight 1 MiB PageRun frames), against the bare TLS channel of
tls_transfer.py (two processes, Python ssl, nothing of kvfence) in the same run; with
--before-ref, another tree's Connection beside it. The order of the sides flips every repeat
(ABBA).

Each kvfence transfer does what the PD workers do to the bytes and nothing more:
- sender (prefill): per 1 MiB run, one xxh3 per 64 KiB page over its four 16 KiB blocks, then the
  run sent from four 256 KiB views of a pool-shaped buffer (the merged pool_blocks);
- receiver (decode): each run decrypted into 64 views of 16 KiB (the unmerged placement), each
  hashed into its page's xxh3 as it lands, the digests compared with the run's; after the last
  run, one read-back xxh3 per page (I3's), compared too; then an empty frame back.
A transfer's time is the sender's, from run 0's hash to that frame's arrival. --no-hash drops
every hash (the transport alone). A digest that does not match stops the benchmark. With the
hashes, tls_transfer.py's I3 floor runs beside them: the bare TLS pair with real source and
destination memory and I3's two hash passes (the sender's, the read-back), nothing else.

    .venv/bin/python benchmarks/tls_connection.py --before-ref REF --repeats 40
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MiB = 1 << 20
BLOCK = 16 << 10  # one layer's K or V of a 16-token page of kvfence-tiny
BLOCKS = 4  # K and V of its 2 layers: a page is 64 KiB
PAGES = 16  # per run: 1 MiB
RUNS = 8  # per transfer: 8 MiB
POOL_PAGES = 4 * RUNS * PAGES  # transfers rotate over a 32 MiB pool, as decode's pages do
ROOM = "r" * 32


def _pool(fill: bool) -> list[memoryview]:
    """A pool's layout: per block, the pages one after another (kvio's layer bases)."""
    size = POOL_PAGES * BLOCK
    data = bytearray(os.urandom(BLOCKS * size) if fill else BLOCKS * size)
    return [memoryview(data)[b * size : (b + 1) * size] for b in range(BLOCKS)]


def _page_sums(pool: list[memoryview], first: int, n: int) -> list[int]:
    import xxhash

    sums = []
    for page in range(first, first + n):
        h = xxhash.xxh3_64()
        for base in pool:
            h.update(base[page * BLOCK : (page + 1) * BLOCK])
        sums.append(h.intdigest())
    return sums


def _tls(role: str):  # noqa: ANN202  (the tree's own TlsConfig)
    from kvfence.pd.tls import TlsConfig, load_files

    return TlsConfig(role, load_files(role, None, None, None))


def _exit_with_parent() -> None:
    """The role processes end when the benchmark does (its end of stdin closes)."""

    def watch() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


async def _receiver(hashing: bool) -> None:
    import xxhash

    from kvfence.pd import wire
    from kvfence.pd.transport.tcp import Listener, Placement

    pool = _pool(fill=False)

    async def serve(conn) -> None:  # noqa: ANN001  (the tree's own Connection)
        landing: list[list] = []  # the run being placed: its pages' hashes
        sent: dict[int, tuple[int, ...]] = {}  # first page of each run in: the sender's sums

        def place(msg: wire.Frame, nbytes: int) -> Placement | None:
            if not isinstance(msg, wire.PageRun):
                return None
            first = msg.first
            views = [
                b[(first + p) * BLOCK : (first + p + 1) * BLOCK] for b in pool for p in range(PAGES)
            ]
            hashes = [xxhash.xxh3_64() for _ in range(PAGES)]
            landing[:] = [hashes]
            feeds = [hashes[i % PAGES].update for i in range(len(views))] if hashing else None
            return Placement(views, lambda: True, feeds)

        while True:
            try:
                msg, _ = await conn.recv(place)
            except ConnectionError:
                return
            if isinstance(msg, wire.PageRun):
                if hashing and [h.intdigest() for h in landing[0]] != list(msg.checksums):
                    sys.exit(f"run at page {msg.first}: landing digests differ from the sender's")
                sent[msg.first] = msg.checksums
                continue
            if hashing:  # I3's read-back: every page hashed again from the pool
                for first, sums in sent.items():
                    if _page_sums(pool, first, PAGES) != list(sums):
                        sys.exit(f"run at page {first}: read-back differs from the sender's")
            sent.clear()
            await conn.send(wire.Heartbeat())

    listener = await Listener.start("127.0.0.1", 0, serve, _tls("prefill"))
    print(listener.port, flush=True)
    await asyncio.Event().wait()


async def _sender(port: int, hashing: bool) -> None:
    from kvfence.pd import wire
    from kvfence.pd.transport.tcp import Connection

    pool = _pool(fill=True)
    conn = await Connection.open("127.0.0.1", port, 10, _tls("decode"))
    await conn.send(wire.Heartbeat())  # each side's first frame is the capped hello slot
    await conn.recv()
    print("ready", flush=True)
    transfer = 0
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "go":
        base = (transfer % (POOL_PAGES // (RUNS * PAGES))) * RUNS * PAGES
        transfer += 1
        start = time.perf_counter()
        for run in range(RUNS):
            first = base + run * PAGES
            sums = _page_sums(pool, first, PAGES) if hashing else [0] * PAGES
            views = [b[first * BLOCK : (first + PAGES) * BLOCK] for b in pool]
            await conn.send(wire.PageRun(ROOM, first, BLOCK // 1024, tuple(sums)), views)
        await conn.send(wire.Heartbeat())
        await conn.recv()
        print(time.perf_counter() - start, flush=True)
    conn.close()


class Side:
    """One tree's Connection pair: a receiver and a sender process, the sender driven a
    transfer at a time over its stdin."""

    def __init__(
        self, name: str, tree: Path, certs: Path, hashing: bool, cores: tuple[int, int] | None
    ) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(tree), "KVFENCE_TLS_DIR": str(certs)}
        flag = [] if hashing else ["--no-hash"]
        me = str(Path(__file__).resolve())
        self.procs: list[subprocess.Popen] = []
        send_core, recv_core = cores or (None, None)
        self.receiver = self._start([me, "--role", "receiver", *flag], env, tree, recv_core)
        port = self._line(self.receiver)
        args = [me, "--role", "sender", "--port", port, *flag]
        self.sender = self._start(args, env, tree, send_core)
        assert self._line(self.sender) == "ready", f"{name}: the sender did not connect"

    def _start(
        self, args: list[str], env: dict[str, str], tree: Path, core: int | None
    ) -> subprocess.Popen:
        from benchmarks.common import on_core

        p = subprocess.Popen(
            [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=env, cwd=tree, preexec_fn=on_core(core),
        )  # fmt: skip
        self.procs.append(p)
        return p

    def _line(self, p: subprocess.Popen) -> str:
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        if not line:
            codes = [q.poll() for q in self.procs]
            raise RuntimeError(f"{self.name}: a role process ended (exit statuses {codes})")
        return line

    def transfer(self) -> float:
        """Seconds of one 8 MiB transfer."""
        assert self.sender.stdin is not None
        self.sender.stdin.write("go\n")
        self.sender.stdin.flush()
        return float(self._line(self.sender))

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()  # the sender stops at EOF; the receiver's watcher exits
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _spread(xs: list[float]) -> dict[str, float]:
    """Median and quartiles (nearest rank)."""
    xs = sorted(xs)
    at = lambda f: xs[round(f * (len(xs) - 1))]  # noqa: E731
    return {"median": at(0.5), "q1": at(0.25), "q3": at(0.75), "min": xs[0], "max": xs[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--before-ref", default=None, help="git ref of another tree to compare")
    p.add_argument("--no-hash", action="store_true", help="no xxh3 on either end")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--name", default="tls_connection")
    p.add_argument("--pin", action="store_true", help="each side on a core of its own (common.py)")
    p.add_argument("--role", choices=("receiver", "sender"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    hashing = not a.no_hash
    if a.role == "receiver":
        _exit_with_parent()
        asyncio.run(_receiver(hashing))
        return 0
    if a.role == "sender":
        asyncio.run(_sender(a.port, hashing))
        return 0

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import machine, pin_cores, this_command, write_json
    from benchmarks.tls_transfer import Sink, export_tree
    from kvfence.pd import certs

    cores = pin_cores() if a.pin else None
    if cores is not None:
        os.sched_setaffinity(0, {cores[0]})  # this process is the bare pair's sender
    tmp = Path(tempfile.mkdtemp(prefix="kvfence-tls-connection-"))
    cert_dir = certs.cluster(tmp / "certs")
    trees = [("after", ROOT)]
    if a.before_ref:
        trees.insert(0, ("before", export_tree(a.before_ref, tmp / "before")))
    nbytes = RUNS * PAGES * BLOCKS * BLOCK
    bare_names = ["tls_ceiling"] + (["tls_i3_floor"] if hashing else [])
    times: dict[str, list[float]] = {name: [] for name, _ in trees} | {n: [] for n in bare_names}
    sides: list[Side] = []
    sinks: dict[str, Sink] = {}
    recv_core = None if cores is None else cores[1]
    try:
        for name, tree in trees:
            sides.append(Side(name, tree, cert_dir, hashing, cores))
        for name in bare_names:
            sinks[name] = Sink(cert_dir, True, recv_core, checked=name == "tls_i3_floor")
        runs: list[tuple[str, Side | Sink]] = [(s.name, s) for s in sides] + list(sinks.items())
        for i in range(a.warmup + a.repeats):
            for name, side in runs if i % 2 == 0 else runs[::-1]:
                if isinstance(side, Side):
                    t = side.transfer()
                else:
                    t = nbytes / side.rate(nbytes, MiB)
                if i >= a.warmup:
                    times[name].append(t)
    finally:
        for s in sides:
            s.close()
        for sink in sinks.values():
            sink.close()
    summary: dict[str, object] = {}
    for name, ts in times.items():
        summary[f"{name}_ms"] = _spread([t * 1e3 for t in ts])
    pairs = [(x, y) for x in [s.name for s in sides] + bare_names[1:] for y in bare_names if x != y]
    if a.before_ref:
        pairs.append(("after", "before"))
    for x, y in pairs:
        # A throughput ratio: y's time over x's, repeat by repeat (back to back in one repeat).
        summary[f"{x}_over_{y}_paired"] = _spread(
            [ty / tx for tx, ty in zip(times[x], times[y], strict=True)]
        )
    for k, v in summary.items():
        print(f"{k}: median {v['median']:.2f}, IQR {v['q1']:.2f}-{v['q3']:.2f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "before_ref": a.before_ref,
            "hashing": hashing,
            "pinned": None if cores is None else {"sending": cores[0], "receiving": cores[1]},
            "bytes": nbytes,
            "times_s": times,
            # for a profiler's eye: which process was which (perf record -a, then per pid)
            "pids": {s.name: {"receiver": s.receiver.pid, "sender": s.sender.pid} for s in sides},
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
