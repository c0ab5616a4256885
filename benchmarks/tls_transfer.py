"""The cost of I8's TLS on the tcp KV transfer, in one run, interleaved by repeat:

- before: the tcp backend of another tree (default: `main`, exported with `git archive`), i.e.
  plaintext frames under the old AES-GMAC (its workers get KVFENCE_CLUSTER_SECRET);
- after: this tree's tcp backend, TLS 1.3 with mutual certificates (KVFENCE_TLS_DIR);
- the ceiling: two bare processes (this one sending, a sink process receiving) moving the same
  bytes over the same kind of TLS channel (Python ssl, TLS 1.3, the same EC certificates, the
  sender's 8 MiB SSL_writes, the sink's recv_into a reused buffer) with nothing of kvfence;
- the I3 floor: the same bare TLS pair doing what I3 asks of any transfer and nothing else of
  kvfence: the sender reads a source four transfers long (transfers rotate over it, as pool
  pages do) and hashes each 64 KiB page (xxh3) before sending it, in 1 MiB pieces as kvfence's
  tcp runs; the sink lands the bytes in a destination four transfers long and reads every page
  back against the sender's digests. Its ratio to the ceiling is what keeping the bytes (no
  hot buffers) and checking them as I3 asks cost the bare pair itself, on the same channel;
- raw loopback TCP between the same two processes, for scale.

kvfence's figure is a transfer window (prefill's send_start to decode's done_handled, the
workers' own marks in /pd/info; kv_transfer.py says what it holds), the others the wall time
of the same bytes after the handshake. Each side is a `kvfence serve` pair of OS processes with
torch kernels (compute is outside the window; no native build needed for the exported tree).
The request goes straight to decode naming its prefill, as the router sends it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    PIN_HELP,
    RESULTS,
    machine,
    on_core,
    pin_cores,
    random_prompts,
    this_command,
    write_json,
)
from benchmarks.pd_workers import PDWorkers  # noqa: E402

# The TLS sink: per connection (TLS, client certificate required), an 8-byte length, then that
# many bytes read into a reused 1 MiB buffer, then a 1-byte ack; length 0 ends it. argv: ROOT,
# the certificate directory, "tls", "raw" or "checked". "checked" is the TLS sink doing what I3
# asks of any receiver and nothing else: the bytes land in a destination four transfers long
# (transfers rotate over it, as decode's pool pages do, so it is not a cache-hot buffer), then
# every CHECK_PAGE bytes are read back with xxh3 and compared with the digests the sender sends
# after the data (8 bytes each); the ack is b"x" when one differs.
_SINK = r"""
import socket, ssl, sys
mode = sys.argv[3]
tls = mode != "raw"
checked = mode == "checked"
if checked:
    import xxhash
    PAGE = int(sys.argv[4])
if tls:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(sys.argv[2] + "/prefill.crt", sys.argv[2] + "/prefill.key")
    ctx.load_verify_locations(sys.argv[2] + "/ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.options |= ssl.OP_NO_TICKET
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
buf = memoryview(bytearray(1 << 20))
dst = None
transfer = 0
def read_into(conn, view):
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:])
        if not n:
            return False
        got += n
    return True
while True:
    raw, _ = srv.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A stray client (another process polling /health on a port this sink was handed since)
    # fails the handshake or sends no sane length: dropped, the sink keeps serving.
    try:
        conn = ctx.wrap_socket(raw, server_side=True) if tls else raw
        head = bytearray(8)
        if not read_into(conn, memoryview(head)):
            raise OSError("closed before the length")
    except (ssl.SSLError, OSError):
        raw.close()
        continue
    total = int.from_bytes(head, "big")
    if total >= 1 << 40:
        conn.close()
        continue
    if not total:
        break
    if not checked:
        got = 0
        while got < total:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        conn.sendall(b"k")
        conn.close()
        continue
    if dst is None or len(dst) < 4 * total:
        dst = memoryview(bytearray(4 * total))
    at = (transfer % 4) * total
    transfer += 1
    land = dst[at : at + total]
    pages = -(-total // PAGE)
    sums = bytearray(8 * pages)
    ok = read_into(conn, land) and read_into(conn, memoryview(sums))
    back = b"".join(
        xxhash.xxh3_64_intdigest(land[p * PAGE : (p + 1) * PAGE]).to_bytes(8, "big")
        for p in range(pages)
    )
    conn.sendall(b"k" if ok and back == sums else b"x")
    conn.close()
"""
CHECK_PAGE = 64 << 10  # "checked": a page of kvfence-tiny (16 tokens, K and V of 2 layers)


class Sink:
    """The bare receiving process; rate() is the sending side, in this process. checked: the
    TLS pair doing I3's checks and nothing else of kvfence (see _SINK): the sender hashes every
    CHECK_PAGE of a frame before it sends the frame, from a source four transfers long that
    transfers rotate over, and sends the digests after the data; the sink reads every page
    back from where it landed and compares."""

    def __init__(
        self, certs: Path, tls: bool, core: int | None = None, checked: bool = False
    ) -> None:
        self.tls = tls or checked
        self.checked = checked
        mode = "checked" if checked else "tls" if tls else "raw"
        self.p = subprocess.Popen(
            [sys.executable, "-c", _SINK, str(ROOT), str(certs), mode, str(CHECK_PAGE)],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=on_core(core),
        )
        assert self.p.stdout is not None
        self.port = int(self.p.stdout.readline())
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(str(certs / "decode.crt"), str(certs / "decode.key"))
        ctx.load_verify_locations(str(certs / "ca.crt"))
        ctx.check_hostname = False
        self.ctx = ctx
        self._source: memoryview | None = None
        self._transfers = 0

    def _connect(self) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.ctx.wrap_socket(raw) if self.tls else raw

    def rate(self, total: int, frame: int) -> float:
        if self.checked:
            return self._checked_rate(total, frame)
        payload = memoryview(bytearray(os.urandom(frame)))
        with self._connect() as c:
            start = time.perf_counter()  # after the handshake, as kvfence's window is
            c.sendall(total.to_bytes(8, "big"))
            sent = 0
            while sent < total:
                part = payload[: min(frame, total - sent)]
                c.sendall(part)
                sent += part.nbytes
            assert c.recv(1) == b"k"
            return total / (time.perf_counter() - start)

    def _checked_rate(self, total: int, frame: int) -> float:
        import xxhash

        if frame % CHECK_PAGE:
            raise ValueError(f"checked frames must be whole pages of {CHECK_PAGE} bytes")
        if self._source is None or self._source.nbytes < 4 * total:
            self._source = memoryview(bytearray(os.urandom(4 * total)))
        at = (self._transfers % 4) * total
        self._transfers += 1
        data = self._source[at : at + total]
        digests = bytearray()
        with self._connect() as c:
            start = time.perf_counter()
            c.sendall(total.to_bytes(8, "big"))
            for first in range(0, total, frame):
                part = data[first : first + frame]
                for p in range(0, part.nbytes, CHECK_PAGE):
                    h = xxhash.xxh3_64_intdigest(part[p : p + CHECK_PAGE])
                    digests += h.to_bytes(8, "big")
                c.sendall(part)
            c.sendall(digests)
            ack = c.recv(1)
            elapsed = time.perf_counter() - start
        if ack != b"k":
            raise RuntimeError(f"the checked sink's read-back did not match ({ack!r})")
        return total / elapsed

    def close(self) -> None:
        with self._connect() as c:
            c.sendall((0).to_bytes(8, "big"))
        self.p.wait(10)


def export_tree(ref: str, into: Path) -> Path:
    """`git archive ref` unpacked into `into` (the repository itself is only read)."""
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


# Paired ratios reported (throughput of x over y, repeat by repeat).
RATIOS = (
    ("after", "tls_ceiling"),
    ("after", "tls_i3_floor"),
    ("tls_i3_floor", "tls_ceiling"),
    ("after", "before"),
)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default=str(ROOT / "models" / "kvfence-tiny"))
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--before-ref", default="main", help="git ref of the GMAC tree")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="tls_transfer")
    p.add_argument("--pin", action="store_true", help=PIN_HELP)
    p.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="fresh processes for every side this many times, the repeats split among them: "
        "two identical worker pairs differ by up to 10%% (RESULTS.md, 'KV transfer'), so a window "
        "A/B needs several pairs per side",
    )
    a = p.parse_args(argv)
    if not 1 <= a.pairs <= a.repeats:
        p.error("--pairs must be between 1 and --repeats")
    send_core, recv_core = pin_cores() if a.pin else (None, None)
    if send_core is not None:
        os.sched_setaffinity(0, {send_core})  # this process is the bare pairs' sender
    a.ctx = max(4096, a.prompt_len + 16)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine
    from kvfence.pd import certs, kvio
    from kvfence.pd.transport.tcp_link import TcpSender

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    pool = Engine(EngineConfig(model=a.model, context_length=a.ctx, kv_pool_tokens=2 * a.ctx)).pool
    nbytes = kvio.payload_size(pool, a.prompt_len)
    # Enough transfers for decode's pool to hand out every page once (first-touch page faults).
    warmup = max(1, -(-pool.num_pages // -(-a.prompt_len // pool.page_size)))
    del pool
    n_prompts = a.repeats + a.pairs * warmup
    prompts = random_prompts(n_prompts, a.prompt_len, int(cfg["vocab_size"]), seed=7)
    frame = min(kvio.RUN_BYTES, nbytes)

    tmp = Path(tempfile.mkdtemp(prefix="kvfence-tls-bench-"))
    cert_dir = certs.cluster(tmp / "certs")
    before_tree = export_tree(a.before_ref, tmp / "before")
    torch_kernels = ["--attention-backend", "torch", "--linear-backend", "torch"]

    def workers(name: str, tree: Path, env: dict[str, str]) -> PDWorkers:
        logs = out / f"tls_transfer-{name}"
        cores = None if send_core is None else (send_core, recv_core)
        return PDWorkers(name, a.model, a.ctx, 2 * a.ctx, logs, env, tree, torch_kernels, cores)

    envs = {
        # A GMAC tree reads the secret, a TLS one (the smoke test's HEAD) the certificates.
        "before": {"KVFENCE_CLUSTER_SECRET": "bench-" + "0" * 40, "KVFENCE_TLS_DIR": str(cert_dir)},
        "after": {"KVFENCE_TLS_DIR": str(cert_dir)},
    }
    trees = {"before": before_tree, "after": ROOT}
    bare_names = ("tls_ceiling", "tls_i3_floor", "raw_tcp")
    rates: dict[str, list[float]] = {n: [] for n in ("before", "after", *bare_names)}
    pair_of: list[int] = []  # per repeat, which set of processes ran it
    todo = iter(prompts)
    for pair in range(a.pairs):
        # The sides start in turns, so neither always starts first.
        names = ["before", "after"] if pair % 2 == 0 else ["after", "before"]
        sides: list[PDWorkers] = []
        bare: list[tuple[str, Sink]] = []
        try:
            sides += [workers(n, trees[n], envs[n]) for n in names]
            bare += [("tls_ceiling", Sink(cert_dir, True, recv_core))]
            bare += [("tls_i3_floor", Sink(cert_dir, True, recv_core, checked=True))]
            bare += [("raw_tcp", Sink(cert_dir, False, recv_core))]
            share = a.repeats // a.pairs + (pair < a.repeats % a.pairs)
            for i in range(warmup + share):
                prompt = next(todo)
                # ABBA: the order flips every repeat, so whatever the first (or last) slot of a
                # repeat gains or loses falls on each side equally.
                for w in sides if i % 2 == 0 else sides[::-1]:
                    wall = w.transfer(prompt)
                    if i >= warmup:
                        rates[w.name].append(nbytes / wall)
                if i >= warmup:
                    for name, sink in bare if i % 2 == 0 else bare[::-1]:
                        # The floor hashes and sends in kvfence's tcp runs (1 MiB), so its
                        # hashing overlaps the receiver's work as the workers' does.
                        size = TcpSender.run_bytes if sink.checked else frame
                        rates[name].append(sink.rate(nbytes, size))
                    pair_of.append(pair)
        finally:
            for w in sides:
                w.close()
            for _, sink in bare:
                sink.close()
    med = {k: _median(v) / 1e6 for k, v in rates.items()}
    # Repeat by repeat (each pair ran back to back, so under a shared machine's load swings the
    # paired ratio is steadier than a ratio of medians).
    paired = {
        f"{x}_over_{y}_paired_median": _median(
            [p / q for p, q in zip(rates[x], rates[y], strict=True)]
        )
        for x, y in RATIOS
    }
    # The same per set of processes: how far pairs of identical code drift apart.
    per_pair = {
        f"{x}_over_{y}_paired_median_per_pair": [
            _median([rates[x][i] / rates[y][i] for i in range(len(pair_of)) if pair_of[i] == k])
            for k in range(a.pairs)
        ]
        for x, y in RATIOS
    }
    summary = {
        **{f"{k}_median_MBps": v for k, v in med.items()},
        **paired,
        "after_over_tls_ceiling": med["after"] / med["tls_ceiling"],
        "after_over_before": med["after"] / med["before"],
        "before_over_raw_tcp": med["before"] / med["raw_tcp"],
        "tls_ceiling_over_raw_tcp": med["tls_ceiling"] / med["raw_tcp"],
    }
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")
    for k, vs in per_pair.items():
        print(f"{k}: {' '.join(f'{v:.2f}' for v in vs)}")
    write_json(
        out / f"{a.name}.json",
        {
            "command": this_command(),
            "machine": machine(),
            "before_ref": a.before_ref,
            "pinned": None if send_core is None else {"sending": send_core, "receiving": recv_core},
            "prompt_len": a.prompt_len,
            "kv_bytes": nbytes,
            "send_bytes": frame,
            "warmup": warmup,
            "worker_commands": [c for w in sides for c in w.commands],
            "rates_Bps": rates,
            "pairs": a.pairs,
            "pair_of_repeat": pair_of,
            "summary": {**summary, **per_pair},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
