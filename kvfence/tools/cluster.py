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


class LocalCluster:
    def __init__(
        self,
        workdir: Path,
        model: str | Path,
        *up_args: str,
        keys: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 240.0,
    ) -> None:
        port = free_port()
        # Ours, so this harness can read the workers' internals as their operator.
        self.operator_key = new_operator_key()
        key_file = workdir / "operator-key"
        key_file.write_text(self.operator_key)
        key_file.chmod(0o600)
        self.operator = operator_headers(self.operator_key)
        self.url = f"http://127.0.0.1:{port}"
        self.log = workdir / "up.log"
        cmd = [
            sys.executable,
            "-m",
            "kvfence.cli",
            "up",
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
            cmd += ["--api-key-file", str(write_key_file(workdir / "keys.txt", keys))]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        deadline = time.monotonic() + startup_timeout
        while "ready on" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvfence up did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def post(self, body: dict, key: str | None = None, timeout: float = 120) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=timeout)

    def workers(self) -> list[dict]:
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
