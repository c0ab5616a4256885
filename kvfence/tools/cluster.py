"""LocalCluster: `kvfence up` as a child process group, for tests, the chaos soak and benchmarks:
start it, wait for its ready line, look at its workers, and stop it with no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvfence.server.operator import new_operator_key, operator_headers
from kvfence.tools.ports import free_port


def write_key_file(path: Path, keys: dict[str, str]) -> Path:
    path.write_text("".join(f"{key} {tenant}\n" for key, tenant in keys.items()))
    return path


# What each command prints once it serves, and what `up` prints when a SIGHUP's rolling
# restart has brought every worker back.
_READY = {"up": "ready on", "serve": "kvfence ready:"}
_RESTARTED = "rolling restart done"


class LocalCluster:
    """`kvfence up` (command="up": a router and PD workers) or one unified `kvfence serve`
    (command="serve"), started with the up_args given."""

    def __init__(
        self,
        workdir: Path,
        model: str | Path,
        *up_args: str,
        keys: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 240.0,
        command: str = "up",
    ) -> None:
        port = free_port()
        # Ours, so this harness can read the workers' internals as their operator.
        self.operator_key = new_operator_key()
        key_file = workdir / "operator-key"
        key_file.write_text(self.operator_key)
        key_file.chmod(0o600)
        self.operator = operator_headers(self.operator_key)
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / f"{command}.log"
        self.command = command
        self.startup_timeout = startup_timeout
        self._cmd = [
            sys.executable,
            "-m",
            "kvfence.cli",
            command,
            "--model",
            str(model),
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--admin-api-key-file",
            str(key_file),
            *up_args,
        ]
        if keys:
            self._cmd += ["--api-key-file", str(write_key_file(workdir / "keys.txt", keys))]
        self._env = {**os.environ, **(env or {})}
        self.log.write_bytes(b"")
        self._spawn()

    def _spawn(self) -> None:
        # Appended to: a restarted server's log follows the one before it.
        ready = self.log.read_text().count(_READY[self.command])
        self.proc = subprocess.Popen(
            self._cmd,
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            env=self._env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout
        while self.log.read_text().count(_READY[self.command]) <= ready:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"kvfence {self.command} did not start:\n{self.log.read_text()[-3000:]}"
                )
            time.sleep(0.3)

    def restart(self) -> None:
        """Restart the workers as an operator would: SIGHUP to `up` (its rolling restart, which
        runs on while this returns: see restarts_done), or for `serve` a SIGTERM (it drains and
        exits) and the same command again on the same port, waited for."""
        if self.command == "up":
            os.kill(self.proc.pid, signal.SIGHUP)
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(self.startup_timeout)
        self._spawn()

    def restarts_done(self) -> int:
        """Rolling restarts `up` finished (a `serve` restart is done when restart() returns)."""
        return self.log.read_text().count(_RESTARTED)

    def post(self, body: dict, key: str | None = None, timeout: float = 120) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=timeout)

    def workers(self) -> list[dict]:
        if self.command == "serve":
            r = httpx.get(f"{self.url}/health", timeout=5, headers=self.operator)
            return [{"url": self.url, "role": "unified", "healthy": r.status_code == 200}]
        return httpx.get(f"{self.url}/health", timeout=5, headers=self.operator).json()["workers"]

    def worker_url(self, role: str) -> str:
        return next(w["url"] for w in self.workers() if w["role"] == role)

    def counters(self, role: str) -> dict:
        url = f"{self.worker_url(role)}/pd/info"
        return httpx.get(url, timeout=5, headers=self.operator).json()["counters"]

    def pages_used(self) -> list[int]:
        """Used KV pages of every worker, in /health's order."""
        return [worker_pages_used(w["url"], self.operator_key) for w in self.workers()]

    def role_pages_used(self, role: str) -> int:
        return worker_pages_used(self.worker_url(role), self.operator_key)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def worker_pages_used(worker_url: str, operator_key: str | None = None) -> int:
    headers = operator_headers(operator_key) if operator_key else {}
    text = httpx.get(f"{worker_url}/metrics", timeout=5, headers=headers).text
    return int(float(re.search(r"^kvfence_pool_pages_used (\S+)$", text, re.M)[1]))
