"""Start kvfence roles as real OS processes for tests, and read their pools over HTTP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from conftest import TINY_MODEL
from waiting import wait_for

from kvfence.server.operator import operator_headers
from kvfence.tools.cluster import free_port, worker_pages_used

__all__ = ["OPERATOR", "OPERATOR_KEY", "Proc", "free_port", "running", "serve"]

# The operator key every role started here holds (a decode needs one to check its router's
# signed prefill address); tests read /pd/info and /metrics with OPERATOR.
OPERATOR_KEY = "op-tests-0123456789abcdef0123456789abcdef"
OPERATOR = operator_headers(OPERATOR_KEY)


class Proc:
    def __init__(
        self,
        args: list[str],
        port: int,
        log: Path,
        env: dict[str, str] | None = None,
        own_group: bool = False,
    ):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        full_env = {**os.environ, "KVFENCE_ADMIN_API_KEY": OPERATOR_KEY, **(env or {})}
        self.p = subprocess.Popen(
            [sys.executable, "-m", "kvfence.cli", *args],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=own_group,  # so a test can signal its group as `kvfence up` does
        )

    def wait_healthy(self, timeout: float = 120) -> None:
        def healthy() -> bool:
            if self.p.poll() is not None:
                raise RuntimeError(f"exited {self.p.returncode}: {self.log.read_text()[-2000:]}")
            try:
                return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        def log_tail() -> str:
            return f"{self.url} not healthy: {self.log.read_text()[-2000:]}"

        wait_for(healthy, timeout, log_tail, interval=0.2)

    def pages_used(self) -> int:
        return worker_pages_used(self.url, OPERATOR_KEY)

    def kill(self) -> None:
        self.p.kill()
        self.p.wait(10)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def serve(
    role: str,
    tmp: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    own_group: bool = False,
) -> Proc:
    port = free_port()
    args = [
        "serve",
        "--model",
        str(TINY_MODEL),
        "--port",
        str(port),
        "--kv-pool-tokens",
        "8192",
        "--disaggregation-mode",
        role,
        "--disaggregation-timeout",
        "10",
        *extra,
    ]
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(free_port())]
    return Proc(args, port, tmp / f"{role}-{port}.log", env, own_group)


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed parent's orphan waits for a reaper that may be slow)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
