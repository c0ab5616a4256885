"""PDWorkers: a 1P1D pair of `kvfence serve` OS processes (prefill + decode) of any kvfence
tree, and one prompt's transfer window read from the workers' own marks. Shared by the
transfer benchmarks (kv_transfer.py, tls_transfer.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import ROOT, on_core


class PDWorkers:
    """`kvfence serve --disaggregation-mode prefill|decode` of `tree` as two OS processes, with
    `env` added and `args` appended to both command lines; their output goes to
    `{logs}-{role}.log`; with `cores` (prefill's, decode's) each process stays on its core. The
    request goes straight to decode naming its prefill, signed as the router signs it."""

    def __init__(
        self,
        name: str,
        model: str,
        ctx: int,
        pool_tokens: int,
        logs: Path,
        env: dict[str, str],
        tree: Path = ROOT,
        args: Sequence[str] = (),
        cores: tuple[int, int] | None = None,
    ) -> None:
        import httpx

        from kvfence.server.hop import sign_prefill
        from kvfence.server.operator import new_operator_key, operator_headers
        from kvfence.tools.cluster import free_port

        self.name = name
        self.http = httpx.Client(timeout=300)
        # The operator key reads /pd/info and signs the prefill address as the router does; a
        # tree from before the operator credential ignores both.
        operator_key = new_operator_key()
        self.sign = lambda peer: sign_prefill(operator_key, peer)
        self.http.headers.update(operator_headers(operator_key))
        full = {**os.environ, **env, "PYTHONPATH": str(tree), "KVFENCE_ADMIN_API_KEY": operator_key}
        full["PYTHONFAULTHANDLER"] = "1"  # a worker killed by a fatal signal logs its stacks
        full.pop("KVFENCE_FAULT_INJECTION", None)
        self.procs: list[subprocess.Popen] = []
        self.urls: dict[str, str] = {}
        self.commands: list[list[str]] = []
        self.logs: list[Path] = []
        for i, role in enumerate(("prefill", "decode")):
            port = free_port()
            cmd = [
                sys.executable, "-m", "kvfence.cli", "serve", "--model", model,
                "--port", str(port), "--context-length", str(ctx),
                "--kv-pool-tokens", str(pool_tokens), "--disaggregation-mode", role,
                "--log-level", "warning", *args,
            ]  # fmt: skip
            if role == "prefill":
                cmd += ["--disaggregation-bootstrap-port", str(free_port())]
            self.logs.append(Path(f"{logs}-{role}.log"))
            log = self.logs[-1].open("wb")
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=full,
                    cwd=tree,
                    preexec_fn=on_core(None if cores is None else cores[i]),
                )
            )
            self.commands.append(cmd)
            self.urls[role] = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy()
        except BaseException:
            self.close()  # a worker that did start must not outlive a failed start
            raise
        info = self.http.get(f"{self.urls['prefill']}/pd/info").json()
        self.peer = f"{info['bootstrap_host']}:{info['bootstrap_port']}"
        self.model_name = info["model"]
        self.seen: set[str] = set()

    def transfer(self, prompt: list[int]) -> float:
        """Seconds of one prompt's transfer window: prefill's send_start to decode's
        done_handled (decode stamps the end on its loop, possibly after the client already has
        its answer: wait for it)."""
        import httpx

        try:
            r = self.http.post(
                f"{self.urls['decode']}/v1/completions",
                json={"model": self.model_name, "prompt": prompt, "max_tokens": 1,
                      "temperature": 0, "ignore_eos": True},
                headers=self.sign(self.peer),  # as the router signs it
            )  # fmt: skip
        except httpx.HTTPError as e:
            raise AssertionError(f"{self.name}: {e!r}\n{self.evidence()}") from e
        assert r.status_code == 200, f"{self.name}: {r.status_code} {r.text}\n{self.evidence()}"
        deadline = time.monotonic() + 10
        while True:
            marks = self.http.get(f"{self.urls['decode']}/pd/info").json()["transfer_marks"]
            new = [k for k, m in marks.items() if k not in self.seen and "done_handled" in m]
            if new:
                break
            assert time.monotonic() < deadline, (
                f"{self.name}: DONE handling never finished\n{self.evidence()}"
            )
            time.sleep(0.002)
        assert len(new) == 1, new
        room = new[0]
        self.seen.add(room)
        sent = self.http.get(f"{self.urls['prefill']}/pd/info").json()["transfer_marks"][room]
        return marks[room]["done_handled"] - sent["send_start"]

    def evidence(self) -> str:
        """Each worker's exit status (None: running; negative: the signal that ended it) and
        its log's tail: what a failed run is explained by."""
        out = []
        for p, log in zip(self.procs, self.logs, strict=True):
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            out.append(f"--- {log} (exit status {p.poll()}) ---\n{tail}")
        return "\n".join(out)

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + 300
        for role, url in self.urls.items():
            while True:
                assert time.monotonic() < deadline, f"{self.name} {role} never became healthy"
                assert all(p.poll() is None for p in self.procs), f"{self.name} {role} exited"
                try:
                    if self.http.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.http.close()
