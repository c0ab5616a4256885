"""The cost of I8's TLS on the tcp KV transfer, in one run, interleaved by repeat:

- before: the tcp backend of another tree (default: `main`, exported with `git archive`), i.e.
  plaintext frames under the old AES-GMAC (its workers get KVFENCE_CLUSTER_SECRET);
- after: this tree's tcp backend, TLS 1.3 with mutual certificates (KVFENCE_TLS_DIR);
- the ceiling: two bare processes (this one sending, a sink process receiving) moving the same
  bytes over the same kind of TLS channel (Python ssl, TLS 1.3, the same EC certificates, the
  sender's 8 MiB SSL_writes, the sink's recv_into a reused buffer) with nothing of kvfence;
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
# the certificate directory, "tls" or "raw".
_SINK = r"""
import socket, ssl, sys
tls = sys.argv[3] == "tls"
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
while True:
    raw, _ = srv.accept()
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # A stray client (another process polling /health on a port this sink was handed since)
    # fails the handshake or sends no sane length: dropped, the sink keeps serving.
    try:
        conn = ctx.wrap_socket(raw, server_side=True) if tls else raw
        head = b""
        while len(head) < 8:
            part = conn.recv(8 - len(head))
            if not part:
                raise OSError("closed before the length")
            head += part
    except (ssl.SSLError, OSError):
        raw.close()
        continue
    total = int.from_bytes(head, "big")
    if total >= 1 << 40:
        conn.close()
        continue
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


class Sink:
    """The bare receiving process; rate() is the sending side, in this process."""

    def __init__(self, certs: Path, tls: bool, core: int | None = None) -> None:
        self.tls = tls
        self.p = subprocess.Popen(
            [sys.executable, "-c", _SINK, str(ROOT), str(certs), "tls" if tls else "raw"],
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

    def _connect(self) -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", self.port))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self.ctx.wrap_socket(raw) if self.tls else raw

    def rate(self, total: int, frame: int) -> float:
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
        "two identical worker pairs differ by up to 10%% (RESULTS.md session 17), so a window "
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
    rates: dict[str, list[float]] = {"before": [], "after": [], "tls_ceiling": [], "raw_tcp": []}
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
                        rates[name].append(sink.rate(nbytes, frame))
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
        for x, y in (("after", "tls_ceiling"), ("after", "before"))
    }
    # The same per set of processes: how far pairs of identical code drift apart.
    per_pair = {
        f"{x}_over_{y}_paired_median_per_pair": [
            _median([rates[x][i] / rates[y][i] for i in range(len(pair_of)) if pair_of[i] == k])
            for k in range(a.pairs)
        ]
        for x, y in (("after", "tls_ceiling"), ("after", "before"))
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
