"""`kvfence up`: the one-box PD demo. Starts N prefill + M decode workers and a router, each its own
process group, prefixes their logs by role, and stops them all together (no orphans). SIGHUP is a
rolling restart: one worker at a time is drained (SIGTERM), restarted on its ports and waited for
until the router has it back in rotation, decodes first."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

import httpx

from kvfence.config import ConfigError
from kvfence.env import admin_api_key
from kvfence.lifetime import DIE_WITH_ENV
from kvfence.pd import certs
from kvfence.pd.certs import TlsFiles
from kvfence.pd.local_prefill import UP_FACTOR
from kvfence.server.operator import load_operator_key, new_operator_key, operator_headers
from kvfence.tools.ports import free_port
from kvfence.tools.up_config import (
    UpConfig,
    add_up_args,
    router_command,
    worker_args,
    worker_command,
)

TAIL_LINES = 40
_POLL_S = 0.2

_print_lock = threading.Lock()


def say(line: str, *, err: bool = False) -> None:
    # Reader threads print too: one lock keeps every line whole.
    with _print_lock:
        stream = sys.stderr if err else sys.stdout
        stream.write(line + "\n")
        stream.flush()


def _free_ports(host: str, n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:  # the OS may hand the same one back once we let it go
            ports.append(port)
    return ports


# ---- certificates ------------------------------------------------------------------------------


def make_certificates(state: Path, host: str, n_prefill: int, n_decode: int) -> list[TlsFiles]:
    """I8: a fresh cluster CA in `state` and a short-lived certificate per worker (prefill-0..,
    then decode-0..), keys 0600. The CA key is deleted once they are signed: nothing can issue
    another certificate of this cluster afterwards."""
    certs.make_ca(state)
    out = [certs.issue(state, "prefill", state, f"prefill-{i}", (host,)) for i in range(n_prefill)]
    out += [certs.issue(state, "decode", state, f"decode-{i}", (host,)) for i in range(n_decode)]
    (state / "ca.key").unlink()
    return out


# ---- processes ---------------------------------------------------------------------------------


class Child:
    """One worker or router process in its own process group, its output relayed line by line."""

    def __init__(self, name: str, cmd: list[str], url: str) -> None:
        self.name = name
        self.cmd = cmd
        self.url = url
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        # DIE_WITH_ENV: if `up` itself is SIGKILLed (no chance to stop anyone), the kernel kills
        # each child (kvfence/lifetime.py), so no worker is left holding its ports and pool.
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{DIE_WITH_ENV: str(os.getpid())})
        # Own session: a terminal's Ctrl-C reaches only `up`, which then stops children in order;
        # and killpg reaches anything a child spawned.
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(
            target=self._relay, args=(self.proc.stdout,), name=f"log-{name}", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        return self.proc.poll()

    def _relay(self, stream: IO[bytes]) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.tail.append(line)
            say(f"[{self.name}] {line}")
        stream.close()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already

    def finish(self) -> None:
        self._reader.join(timeout=2)

    def report(self, why: str) -> None:
        say(f"kvfence up: {self.name} (pid {self.pid}) {why}; its last log lines:", err=True)
        for line in self.tail:
            say(f"  [{self.name}] {line}", err=True)


def stop_all(stages: Sequence[Sequence[Child]], grace: float) -> None:
    """SIGTERM stage by stage, SIGKILL what outlives the grace, reap everything, sweep groups."""
    for stage in stages:
        live = [c for c in stage if c.exited() is None]
        for c in live:
            c.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in live:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                say(f"kvfence up: {c.name} ignored SIGTERM for {grace:g} s; killing it", err=True)
            except KeyboardInterrupt:
                pass  # a second Ctrl-C: no more waiting, the sweep below kills
    for stage in stages:
        for c in stage:
            # Also reaches grandchildren of a leader that exited on its own.
            c.signal_group(signal.SIGKILL)
            c.proc.wait()
            c.finish()


class StartupError(RuntimeError):
    pass


def wait_healthy(
    children: Sequence[Child], timeout: float, transport: httpx.BaseTransport | None = None
) -> None:
    """Returns once every child's /health is 200; raises if one exits or time runs out.
    `transport` stands in for the network in tests."""
    pending = list(children)
    last: dict[str, str] = {c.name: "not listening yet" for c in children}
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0, transport=transport) as client:
        while pending:
            for c in list(pending):
                code = c.exited()
                if code is not None:
                    c.report(f"exited with code {code} during start-up")
                    raise StartupError(f"{c.name} exited during start-up")
                try:
                    r = client.get(c.url + "/health")
                except httpx.HTTPError:
                    continue  # not listening yet
                if r.status_code == 200:
                    pending.remove(c)
                else:  # e.g. a pairing refusal: worth showing if it never clears
                    last[c.name] = f"/health {r.status_code}: {r.text[:300]}"
            if pending and time.monotonic() > deadline:
                states = "; ".join(f"{c.name} ({last[c.name]})" for c in pending)
                raise StartupError(f"not healthy after {timeout:g} s: {states}")
            if pending:
                time.sleep(_POLL_S)


def _operator_headers(up: UpConfig) -> dict[str, str]:
    """What the workers' /pd/info and the router's detailed /health want from `up`."""
    key = load_operator_key(up.node.server.admin_api_key_file)
    return operator_headers(key) if key else {}


def _model_name(up: UpConfig, decode_url: str) -> str:
    headers = _operator_headers(up)
    try:
        name = httpx.get(decode_url + "/pd/info", timeout=2.0, headers=headers).json().get("model")
        if name:
            return str(name)
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    engine = up.node.engine
    return engine.served_model_name or Path(engine.model).name


def ready_lines(up: UpConfig, model: str) -> list[str]:
    server = up.node.server
    url = f"http://{server.host}:{server.port}"
    body = json.dumps(
        {
            "model": model,
            "prompt": "name: Ada\ncode: X7qPz91LmWk2\ncity: Paris\ncode:",
            "max_tokens": 12,
            "temperature": 0,
            "stop": "\n",
        }
    )
    # Never print a real key: the operator has it, logs should not.
    auth = " -H 'Authorization: Bearer YOUR_KEY'" if server.api_key_file else ""
    return [
        f"kvfence up: ready on {url} (router + {up.prefill} prefill + {up.decode} decode, "
        f"model {model})",
        f"  try: curl -s {url}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'",
    ]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_up(args: argparse.Namespace) -> int:
    try:  # refused here, not after every worker has started
        up = UpConfig.from_args(args)
    except ConfigError as e:
        say(f"kvfence up: {e}", err=True)
        return 2
    if up.prefill < 1 or up.decode < 1:
        say("kvfence up: need at least one prefill and one decode worker", err=True)
        return 2
    if not 0 < up.node.server.port < 65536:
        say(
            "kvfence up: --port must be a fixed port (1-65535): it is the address we print",
            err=True,
        )
        return 2
    model = up.node.engine.model
    if not Path(model).is_dir():
        say(f"kvfence up: model directory {model} does not exist (--model)", err=True)
        return 2
    # Children may run elsewhere in the tree; relative paths must not change meaning.
    up = up.with_engine(model=str(Path(model).resolve()))
    if up.node.server.api_key_file:
        up = up.with_server(api_key_file=str(Path(up.node.server.api_key_file).resolve()))
    # I8: this cluster's CA and certificates, in a state directory only this user can read,
    # gone when up exits.
    state_dir = tempfile.TemporaryDirectory(prefix="kvfence-up-")
    tls = make_certificates(Path(state_dir.name), up.worker_host, up.prefill, up.decode)
    if up.node.server.admin_api_key_file:
        up = up.with_server(
            admin_api_key_file=str(Path(up.node.server.admin_api_key_file).resolve())
        )
    elif not admin_api_key():
        # The router and every worker share a fresh operator key; tenants never see it.
        path = Path(state_dir.name) / "operator-key"
        path.touch(mode=0o600)
        path.write_text(new_operator_key())
        up = up.with_server(admin_api_key_file=str(path))
        say(f"kvfence up: operator key (reads /metrics, /pd/info, /health detail) in {path}")

    host, router_port = up.node.server.host, up.node.server.port
    if not _can_bind(host, router_port):
        # Else an old server still on the port could answer our router's health check for it.
        say(f"kvfence up: {_hostport(host, router_port)} is in use (--port)", err=True)
        return 2

    engine = up.node.engine
    up = host_shares(up)
    if engine.device == "cpu" and engine.threads is None:
        say(f"kvfence up: {up.node.engine.threads} CPU thread(s) per worker (--threads to change)")
    if up.node.pd.decode_borrow_threads:
        say(
            f"kvfence up: the decode worker borrows the prefill worker's "
            f"{up.node.pd.decode_borrow_threads} thread(s) while none of its prompts is there "
            f"(--decode-borrow-threads)"
        )
    if engine.device == "cpu":
        # Build the native kernels once here, not in N+M workers racing on torch's build lock.
        from kvfence.model import kernels

        if engine.attention_backend in ("auto", "native"):
            kernels.paged_decode()
            kernels.paged_prefill()
        if engine.linear_backend != "torch":
            kernels.packed_gemm()

    restart = threading.Event()
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt),
        signal.SIGHUP: signal.signal(signal.SIGHUP, lambda *_: restart.set()),
    }
    prefills: list[Child] = []
    decodes: list[Child] = []
    routers: list[Child] = []
    # Router first (no new work), then decodes (they abort open transfers, which prefills must
    # acknowledge), then prefills.
    stages = (routers, decodes, prefills)
    try:
        wh = up.worker_host
        ports = _free_ports(wh, 2 * up.prefill + up.decode)
        for i in range(up.prefill):
            port, bootstrap = ports.pop(), ports.pop()
            cmd = worker_command(up, "prefill", port, bootstrap, tls[i])
            prefills.append(
                _start(
                    f"prefill-{i}",
                    cmd,
                    f"http://{_hostport(wh, port)}",
                    f"bootstrap port {bootstrap}",
                )
            )
        for i in range(up.decode):
            port = ports.pop()
            cmd = worker_command(up, "decode", port, tls=tls[up.prefill + i])
            decodes.append(_start(f"decode-{i}", cmd, f"http://{_hostport(wh, port)}"))
        wait_healthy(prefills + decodes, up.startup_timeout)
        cmd = router_command(up, [c.url for c in prefills], [c.url for c in decodes])
        reach = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
        routers.append(_start("router", cmd, f"http://{_hostport(reach, router_port)}"))
        wait_healthy(routers, up.startup_timeout)
        for line in ready_lines(up, _model_name(up, decodes[0].url)):
            say(line)
        say(f"kvfence up: SIGHUP (kill -HUP {os.getpid()}) restarts the workers one at a time")
        while True:
            code = _watch(prefills + decodes + routers, restart)
            if code is not None:
                return code
            restart.clear()
            if not rolling_restart(up, (decodes, prefills), routers[0].url):
                return 1
    except StartupError as e:
        say(f"kvfence up: start-up failed: {e}", err=True)
        return 1
    except KeyboardInterrupt:
        say("kvfence up: stopping")
        return 0
    finally:
        # A worker drains for up to --drain-timeout before it exits on its own.
        stop_all(stages, up.shutdown_grace + up.node.server.drain_timeout)
        for s, handler in previous.items():
            signal.signal(s, handler)


def host_shares(up: UpConfig, cores: int | None = None) -> UpConfig:
    """What `up` fills in, left unset, for workers that share this host: each worker's share of
    the cores; on one prefill and one decode, the prefill's share lent to the decode's steps
    while none of its prompts is at the prefill worker (pd/local_prefill.py BORROWING: with
    more workers, another's cores may be busy then); a decode that computes prompts itself
    (UP_FACTOR: the decode's spare step time is the prefill's too)."""
    engine = up.node.engine
    if engine.device == "cpu" and engine.threads is None:
        share = threads_per_worker(up.prefill + up.decode, cores)
        up = up.with_engine(threads=share)
        if up.node.pd.decode_borrow_threads is None and up.prefill == up.decode == 1:
            up = up.with_pd(decode_borrow_threads=share)
    if up.node.pd.decode_local_prefill is None:
        up = up.with_pd(decode_local_prefill=UP_FACTOR)
    return up


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Each worker's share of the cores this process may run on. Left at torch's default, every
    worker starts a team of one thread per core, so a prefill's parallel regions and a decode's
    oversubscribe the cores and wait on each other's descheduled threads (benchmarks/up_threads.py,
    2 cores, 1 prefill + 1 decode: p99 ITL 0.70x, TTFT 0.76x, throughput 1.07x with the split)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, workers))


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _start(name: str, cmd: list[str], url: str, extra: str = "") -> Child:
    child = Child(name, cmd, url)
    say(f"kvfence up: started {name} (pid {child.pid}) on {url}" + (f", {extra}" if extra else ""))
    return child


def _watch(children: Sequence[Child], restart: threading.Event) -> int | None:
    """Until a signal: any child ending now is a failure of the whole set (1); None when a
    rolling restart is asked for."""
    while not restart.is_set():
        for c in children:
            code = c.exited()
            if code is not None:
                c.report(f"exited unexpectedly with code {code}; stopping everything")
                return 1
        time.sleep(_POLL_S)
    return None


def rolling_restart(
    up: UpConfig, pools: Sequence[list[Child]], router_url: str
) -> bool:
    """Each worker in turn: SIGTERM (it drains: the router stops sending to it, what it admitted
    finishes), wait for it to exit, start it again with the same command and ports, and wait
    until the router has it back in rotation before touching the next, so capacity never drops
    by more than one worker. False if one cannot be brought back."""
    for pool in pools:
        for i, old in enumerate(pool):
            say(f"kvfence up: rolling restart: draining {old.name} (pid {old.pid})")
            old.signal_group(signal.SIGTERM)
            try:
                code = old.proc.wait(timeout=up.node.server.drain_timeout + up.shutdown_grace)
            except subprocess.TimeoutExpired:
                say(f"kvfence up: {old.name} did not exit after draining; killing it", err=True)
                old.signal_group(signal.SIGKILL)
                code = old.proc.wait()
            old.finish()
            say(f"kvfence up: {old.name} exited with code {code}; starting it again")
            new = _start(old.name, old.cmd, old.url)
            pool[i] = new
            try:
                wait_healthy([new], up.startup_timeout)
                wait_in_rotation(router_url, new.url, up.startup_timeout, _operator_headers(up))
            except StartupError as e:
                say(f"kvfence up: rolling restart failed: {e}", err=True)
                return False
            say(f"kvfence up: {new.name} is back in rotation")
    say("kvfence up: rolling restart done")
    return True


def wait_in_rotation(
    router_url: str, worker_url: str, timeout: float, headers: dict[str, str] | None = None
) -> None:
    """Until the router's /health lists worker_url as healthy (its next health poll). headers:
    whatever the router wants before it shows its workers' detail."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, headers=headers) as client:
        while True:
            try:
                workers = client.get(router_url + "/health").json().get("workers", [])
                if any(w.get("url") == worker_url and w.get("healthy") for w in workers):
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            if time.monotonic() > deadline:
                raise StartupError(f"the router did not take {worker_url} back in {timeout:g} s")
            time.sleep(_POLL_S)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfence up", description="router + N prefill + M decode workers on this machine"
    )
    add_up_args(parser)
    return run_up(parser.parse_args(argv))


__all__ = [
    "UpConfig",
    "add_up_args",
    "free_port",
    "host_shares",
    "main",
    "router_command",
    "run_up",
    "worker_args",
    "worker_command",
]

if __name__ == "__main__":
    sys.exit(main())
