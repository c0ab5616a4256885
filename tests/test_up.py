"""`kvfence up` with fake workers and the real router: flags reach workers, the ready line, and no
orphans whether it is stopped, a worker fails at start-up, or a child dies later."""

from __future__ import annotations

import argparse
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx
import pytest
from conftest import TINY_MODEL
from fake_workers import EXIT_ROLE_ENV, UNHEALTHY_ROLE_ENV, free_port
from procs import running
from waiting import wait_for

from kvfence.args.engine import ENGINE_OPTIONS
from kvfence.args.option import add_options
from kvfence.tools.up import (
    StartupError,
    UpConfig,
    add_up_args,
    host_shares,
    router_command,
    threads_per_worker,
    wait_healthy,
    worker_args,
    worker_command,
)

FAKE = Path(__file__).with_name("fake_workers.py")
REPO = Path(__file__).resolve().parent.parent


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return p.parse_args(list(argv))


def up_config(*argv: str) -> UpConfig:
    return UpConfig.from_args(parse(*argv))


def test_worker_args_carry_every_engine_flag_given_and_the_role(tmp_path: Path) -> None:
    args = parse(
        "--model", str(tmp_path), "--served-model-name", "demo", "--device", "cuda:1",
        "--dtype", "bfloat16", "--kv-cache-dtype", "float16", "--context-length", "2048",
        "--page-size", "32", "--kv-pool-tokens", "65536", "--mem-fraction-static", "0.7",
        "--chunked-prefill-size", "256", "--max-running-requests", "8", "--seed", "5",
        "--decode-step-prefill-budget", "64", "--attention-backend", "torch", "--threads", "3",
        "--api-key-file", "keys.txt", "--disaggregation-transfer-backend", "mooncake",
    )
    up = UpConfig.from_args(args)
    flags = worker_args(up, "prefill")
    # What a worker parses back is what `up` was given: no engine flag is lost on the way.
    serve = argparse.ArgumentParser()
    add_options(serve, ENGINE_OPTIONS)
    for extra in ("--api-key-file", "--log-level", "--disaggregation-mode",
                  "--disaggregation-transfer-backend"):
        serve.add_argument(extra)
    back = serve.parse_args(flags)
    for dest in ("model", "served_model_name", "device", "dtype", "kv_cache_dtype",
                 "context_length", "page_size", "kv_pool_tokens", "mem_fraction_static",
                 "chunked_prefill_size", "decode_step_prefill_budget", "attention_backend",
                 "max_running_requests", "threads", "seed", "api_key_file"):
        assert getattr(back, dest) == getattr(args, dest), dest
    assert back.disaggregation_mode == "prefill"
    assert back.disaggregation_transfer_backend == "mooncake"

    cmd = worker_command(up, "prefill", 1234, 5678)
    assert cmd[1:4] == ["-m", "kvfence.cli", "serve"]
    assert cmd[cmd.index("--port") + 1] == "1234"
    assert cmd[cmd.index("--disaggregation-bootstrap-port") + 1] == "5678"
    assert "--disaggregation-bootstrap-port" not in worker_command(up, "decode", 1234)
    r = router_command(up, ["http://a:1"], ["http://b:2", "http://c:3"])
    assert r[1:4] == ["-m", "kvfence.cli", "router"]
    assert r[r.index("--decode") + 1 : r.index("--decode") + 3] == ["http://b:2", "http://c:3"]


def test_tool_call_parser_reaches_every_worker_that_serves_the_api(tmp_path: Path) -> None:
    from kvfence.cli import build_parser

    args = parse("--model", str(tmp_path), "--tool-call-parser", "hermes")
    for role in ("decode", "prefill"):  # decodes answer the router's chat requests
        back = build_parser().parse_args(["serve", *worker_args(UpConfig.from_args(args), role)])
        assert back.tool_call_parser == "hermes", role
    # Not given: the worker's own default (none: tool_choice auto is refused), not a value.
    assert "--tool-call-parser" not in worker_args(up_config("--model", str(tmp_path)), "decode")


def test_defaults_are_left_to_the_worker(tmp_path: Path) -> None:
    flags = worker_args(up_config("--model", str(tmp_path)), "decode")
    assert flags[:2] == ["--model", str(tmp_path)]
    assert "--page-size" not in flags and "--device" not in flags


def test_up_gives_each_worker_its_share_of_the_cores() -> None:
    assert threads_per_worker(2, cores=2) == 1  # 1 prefill + 1 decode on 2 cores
    assert threads_per_worker(3, cores=16) == 5
    assert threads_per_worker(4, cores=2) == 1  # never 0
    assert threads_per_worker(1) >= 1  # this process's own cores


def test_engine_runs_its_kernels_on_the_threads_it_was_given() -> None:
    import torch

    from kvfence.config import ConfigError, EngineConfig
    from kvfence.engine.engine import Engine

    with pytest.raises(ConfigError, match="--threads"):
        EngineConfig(model=str(TINY_MODEL), threads=0)
    before = torch.get_num_threads()
    try:
        Engine(
            EngineConfig(
                model=str(TINY_MODEL), threads=1, context_length=256, kv_pool_tokens=4096
            )
        )
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_up_lends_the_prefill_share_to_the_decode_of_a_1p1d_pair_only(tmp_path: Path) -> None:
    from kvfence.cli import build_parser

    def shares(*argv: str) -> UpConfig:
        return host_shares(up_config("--model", str(tmp_path), *argv), cores=2)

    pair = shares()
    assert pair.node.engine.threads == 1 and pair.node.pd.decode_borrow_threads == 1
    back = build_parser().parse_args(["serve", *worker_args(pair, "decode")])
    assert (back.threads, back.decode_borrow_threads) == (1, 1)
    # Another worker's cores may be busy while this decode's prompts are not there.
    assert shares("--prefill", "2").node.pd.decode_borrow_threads is None
    assert shares("--decode", "2").node.pd.decode_borrow_threads is None
    # Threads the operator chose are not added to, nor a borrow they set.
    assert shares("--threads", "2").node.pd.decode_borrow_threads is None
    assert shares("--decode-borrow-threads", "0").node.pd.decode_borrow_threads == 0
    assert shares("--device", "cuda").node.pd.decode_borrow_threads is None


def test_engine_runs_each_step_on_the_threads_step_threads_asks() -> None:
    import torch

    from kvfence.config import EngineConfig
    from kvfence.engine.admission import Admitted
    from kvfence.engine.engine import Engine
    from kvfence.engine.request import GenerateRequest, RequestOutput, SamplingParams

    before = torch.get_num_threads()
    engine = Engine(
        EngineConfig(model=str(TINY_MODEL), threads=1, context_length=256, kv_pool_tokens=4096)
    )
    want, seen = [2], []  # seen: torch's count on the engine thread after each pass
    engine.step_threads = lambda: want[0]
    engine.step_end_hooks.append(lambda: seen.append(torch.get_num_threads()))
    done: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def generate(rid: str) -> None:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        out = engine.submit(
            GenerateRequest(rid, "t", (5, 6, 7), params), lambda o: o.finished and done.put(o)
        )
        assert isinstance(out, Admitted), out
        assert done.get(timeout=60).request_id == rid

    try:
        engine.start()
        generate("a")
        assert seen[-1] == 2, seen
        want[0] = 1
        generate("b")
        assert seen[-1] == 1, seen
    finally:
        engine.shutdown()
        torch.set_num_threads(before)


class Up:
    """`kvfence up` with fake workers, its stdout read line by line in a thread."""

    def __init__(self, model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        cmd = [
            sys.executable, "-m", "kvfence.tools.up", "--model", str(model_dir),
            "--port", str(self.port), "--startup-timeout", "60", "--shutdown-grace", "5",
            "--worker-cmd-prefix", f"{sys.executable} {FAKE} serve",
            "--router-cmd-prefix", f"{sys.executable} -m kvfence.server.router",
            "--log-level", "warning", *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, **(env or {})),
        )
        self.lines: list[str] = []
        self.err_lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._q.put), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err_lines.append),
                             daemon=True),
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream: IO[str] | None, put: Callable[[str], None]) -> None:
        assert stream is not None
        for line in stream:
            put(line.rstrip("\n"))

    def wait_line(self, prefix: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line; got {self.lines}") from None
            self.lines.append(line)
            if line.startswith(prefix):
                return line

    def pids(self) -> dict[str, int]:
        found = (re.search(r"started (\S+) \(pid (\d+)\)", ln) for ln in self.lines)
        return {m[1]: int(m[2]) for m in found if m}

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=5)
        while not self._q.empty():
            self.lines.append(self._q.get())
        return code, "\n".join(self.err_lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return tmp_path  # the fakes never read it; `up` only checks it exists


def test_up_serves_through_the_router_and_sigterm_leaves_no_orphans(model_dir: Path) -> None:
    up = Up(model_dir, "--prefill", "2", "--decode", "1", "--served-model-name", "demo")
    try:
        ready = up.wait_line("kvfence up: ready on")
        assert ready == (f"kvfence up: ready on http://127.0.0.1:{up.port} "
                         "(router + 2 prefill + 1 decode, model demo)")
        assert up.wait_line("  try: curl").count(f"http://127.0.0.1:{up.port}/v1/completions")
        pids = up.pids()
        assert sorted(pids) == ["decode-0", "prefill-0", "prefill-1", "router"]
        r = httpx.post(f"http://127.0.0.1:{up.port}/v1/completions",
                       json={"model": "demo", "prompt": "hi"}, timeout=10)
        assert r.status_code == 200 and r.json()["worker"].startswith("decode@")
        assert any(ln.startswith("[prefill-1] fake prefill ready") for ln in up.lines)
        up.proc.send_signal(signal.SIGTERM)
        code, _ = up.finish()
        assert code == 0
        assert [name for name, pid in pids.items() if alive(pid)] == []
    finally:
        up.kill()


def test_up_fails_fast_when_a_worker_exits_at_startup(model_dir: Path) -> None:
    up = Up(model_dir, "--prefill", "1", "--decode", "1", env={EXIT_ROLE_ENV: "decode"})
    try:
        code, err = up.finish(timeout=60)
        assert code != 0
        assert "decode-0" in err and "exited with code 3" in err
        assert "[decode-0] fake decode: refusing to start" in err  # its last lines, on stderr
        pids = up.pids()
        assert "prefill-0" in pids and "router" not in pids
        assert not alive(pids["prefill-0"])
    finally:
        up.kill()


def test_up_gives_up_on_a_worker_that_never_turns_healthy(model_dir: Path) -> None:
    up = Up(model_dir, "--startup-timeout", "1.5", env={UNHEALTHY_ROLE_ENV: "prefill"})
    try:
        code, err = up.finish()
        assert code == 1
        # What the worker last said depends on whether it listened within 1.5 s on a loaded
        # machine; that the message carries it: test_wait_healthy_reports_the_last_health_answer.
        assert "not healthy after 1.5 s: prefill-0" in err
        assert [name for name, pid in up.pids().items() if alive(pid)] == []
    finally:
        up.kill()


def test_up_stops_everything_when_a_child_dies(model_dir: Path) -> None:
    up = Up(model_dir)
    try:
        up.wait_line("kvfence up: ready on")
        pids = up.pids()
        os.kill(pids["decode-0"], signal.SIGKILL)
        code, err = up.finish()
        assert code == 1
        assert "decode-0" in err and "exited unexpectedly" in err
        assert [name for name, pid in pids.items() if alive(pid)] == []
    finally:
        up.kill()


def test_sigkill_of_up_takes_every_child_with_it(model_dir: Path) -> None:
    """`up` SIGKILLed cannot stop anyone; each child armed the parent-death signal at start
    (kvfence/lifetime.py), so the kernel does. tests/test_lifetime.py shows the same wait
    seeing an orphan that did not arm it."""
    up = Up(model_dir)
    pids: dict[str, int] = {}
    try:
        up.wait_line("kvfence up: ready on")
        pids = up.pids()
        assert sorted(pids) == ["decode-0", "prefill-0", "router"]
        up.proc.kill()
        up.proc.wait(timeout=30)
        wait_for(
            lambda: not [n for n, pid in pids.items() if running(pid)],
            15,
            lambda: f"outlived a SIGKILLed up: {[n for n, pid in pids.items() if running(pid)]}",
            interval=0.05,
        )
    finally:
        up.kill()
        for pid in pids.values():
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_wait_healthy_reports_the_last_health_answer() -> None:
    class Quiet:  # a running child: what wait_healthy reads of one
        name, url = "prefill-0", "http://prefill-0"

        def exited(self) -> int | None:
            return None

    def health(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="pairing refused: page_size differs")

    with pytest.raises(StartupError) as e:
        wait_healthy([Quiet()], 0.0, transport=httpx.MockTransport(health))  # type: ignore[list-item]
    assert str(e.value) == (
        "not healthy after 0 s: prefill-0 (/health 503: pairing refused: page_size differs)"
    )


def test_the_decode_local_prefill_factor_reaches_the_workers(tmp_path: Path) -> None:
    from kvfence.cli import build_parser

    up = up_config("--model", str(tmp_path)).with_pd(decode_local_prefill=2.0)
    back = build_parser().parse_args(["serve", *worker_args(up, "decode")])
    assert back.decode_local_prefill == 2.0
