"""The engine in a process of its own (`kvfence serve --engine-process`: kvfence/role_process.py,
kvfence/role_child.py): the same answers as the engine in this process, each stream keyed by its
own handle; when the engine process dies every open stream ends with one error (I5) and no later
request is admitted; when the HTTP process dies, however, the engine process dies with it."""

from __future__ import annotations

import argparse
import pickle
import queue
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from procs import OPERATOR, running, serve
from test_pd_processes import STALL, in_background, post

from kvfence import role_process
from kvfence.cli import build_parser
from kvfence.config import NodeConfig
from kvfence.engine.admission import ENGINE_FAILED, Admitted, Rejected
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput, SamplingParams
from kvfence.faults import Faults
from kvfence.node import build_role
from kvfence.role_process import RemoteRole, spawn_role
from tests.conftest import TINY_MODEL
from tests.waiting import wait_for

WAIT_S = 60.0  # a loaded 2-core machine: the child imports torch and loads the model
PROMPT = (5, 17, 42, 8, 99, 3, 61, 250, 7, 12)


def _config(*extra: str) -> NodeConfig:
    argv = ["serve", "--model", str(TINY_MODEL), "--context-length", "2048",
            "--kv-pool-tokens", "8192", *extra]  # fmt: skip
    return NodeConfig.from_args(build_parser().parse_args(argv))


class _Recording(role_process.Connection):
    """The parent's end of the pipe, keeping what it sends down."""

    sent: list[object] = []

    def send(self, obj: object) -> None:
        _Recording.sent.append(obj)
        super().send(obj)


def _request(rid: str, max_tokens: int = 8, prompt: tuple[int, ...] = PROMPT) -> GenerateRequest:
    return GenerateRequest(
        rid, "tenant-a", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )


class Stream:
    """One request's outputs as the HTTP layer's sink receives them (from the pipe's thread)."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def __call__(self, out: RequestOutput) -> None:
        self.q.put(out)

    def collect(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        while not outs or not outs[-1].finished:
            try:
                outs.append(self.q.get(timeout=WAIT_S))
            except queue.Empty:
                raise AssertionError(f"no final output within {WAIT_S:g} s: {outs}") from None
        return outs


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def remote() -> Iterator[RemoteRole]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(role_process, "Connection", _Recording)
        role = spawn_role(_config())
    role.start()
    yield role
    role.shutdown()


def test_the_engine_process_gets_the_node_config_never_argparse_flags(remote: RemoteRole) -> None:
    """What crosses the pipe first is the NodeConfig the parent built once from the flags:
    no argparse object (the child never parses flags nor imports the CLI)."""
    first = _Recording.sent[0]
    assert type(first) is NodeConfig and first == _config()
    assert b"argparse" not in pickle.dumps(first)
    assert not any(isinstance(m, argparse.Namespace) for m in _Recording.sent)


def test_remote_answers_match_the_engine_in_this_process(remote: RemoteRole) -> None:
    local = build_role(_config(), Faults())
    local.start()
    try:
        want = Stream()
        assert isinstance(local.submit(_request("local-1", 12), want), Admitted)
        expected = want.collect()
    finally:
        local.shutdown()
    got = Stream()
    verdict = remote.submit(_request("remote-1", 12), got)
    assert isinstance(verdict, Admitted) and verdict.max_tokens == 12
    outs = got.collect()
    assert _tokens(outs) == _tokens(expected) and len(_tokens(outs)) == 12
    assert "".join(o.new_text for o in outs) == "".join(o.new_text for o in expected)
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert [o for o in outs if o.finished] == [outs[-1]]  # one final output (I5)
    assert remote.alive and remote.model_name == local.model_name
    assert remote.context_length == local.context_length


def test_calls_reach_the_role_in_the_child(remote: RemoteRole) -> None:
    assert remote.info()["role"] == "unified"
    stats = remote.stats()
    assert stats.pages_total > 0 and stats.running == 0
    assert list(remote.metrics()) == []  # a unified role has no families beyond the pool's
    rejected = remote.submit(_request("too-long", max_tokens=10**6), Stream())
    assert isinstance(rejected, Rejected) and rejected.status == 400


def test_a_duplicate_request_id_cannot_take_over_another_stream(remote: RemoteRole) -> None:
    """Outputs come back keyed by the handle this process picked, not by the request id: the
    engine refuses the second request of an id, and that refusal reaches the second caller
    only, while the first stream runs to its end."""
    first, second = Stream(), Stream()
    assert isinstance(remote.submit(_request("same-id", 24), first), Admitted)
    remote.submit(_request("same-id", 4), second)
    dup = second.collect()
    assert dup[-1].finish_reason is FinishReason.ERROR
    assert dup[-1].error_code == "duplicate_request_id"
    outs = first.collect()
    assert outs[-1].finish_reason is FinishReason.LENGTH and len(_tokens(outs)) == 24


def test_abort_ends_the_stream_with_one_final_output(remote: RemoteRole) -> None:
    s = Stream()
    assert isinstance(remote.submit(_request("to-abort", 2000), s), Admitted)
    first = s.q.get(timeout=WAIT_S)
    remote.abort("to-abort")
    outs = [first, *s.collect()] if not first.finished else [first]
    assert outs[-1].finish_reason is FinishReason.ABORT
    wait_for(lambda: remote.stats().pages_used == 0, WAIT_S, "the aborted request's pages")


def test_a_dead_engine_process_ends_every_open_stream_and_admits_nothing() -> None:
    role = spawn_role(_config())
    try:
        role.start()
        streams = [Stream() for _ in range(3)]
        for i, s in enumerate(streams):
            assert isinstance(role.submit(_request(f"long-{i}", 2000), s), Admitted)
        streams[0].q.get(timeout=WAIT_S)  # the engine is stepping
        role._proc.send_signal(signal.SIGKILL)  # an OOM kill, a segfault
        for s in streams:
            last = s.collect()[-1]
            assert last.finish_reason is FinishReason.ERROR
            assert last.error_code == ENGINE_FAILED and last.error_status == 503
        wait_for(lambda: not role.alive, WAIT_S, "alive after the engine process died")
        later = role.submit(_request("after", 4), Stream())
        assert isinstance(later, Rejected) and later.status == 503
        with pytest.raises(RuntimeError, match="engine process"):
            role.stats()
    finally:
        role.shutdown()
    assert role._proc.returncode == -signal.SIGKILL


def test_a_killed_prefill_worker_stops_transferring_with_its_engine_process(
    tmp_path: Path,
) -> None:
    """SIGKILL leaves the server no cleanup, yet its engine process ends with it (the kernel's
    parent-death signal; the pipe's end would stop it too, a step later): the transfer it was
    stalling in stops, decode answers 503 and frees the room, and no engine process remains."""
    prefill = serve("prefill", tmp_path, "--engine-process", env=STALL)
    decode = serve("decode", tmp_path)
    try:
        for p in (prefill, decode):
            p.wait_healthy(WAIT_S)
        info = httpx.get(f"{prefill.url}/pd/info", headers=OPERATOR).json()
        peer = f"{info['bootstrap_host']}:{info['bootstrap_port']}"
        engine = _children(prefill.p.pid)
        assert len(engine) == 1, engine
        t, box = in_background(lambda: post(decode, peer))
        wait_for(lambda: prefill.pages_used() > 0, WAIT_S, "prefill holding the room", interval=0.1)
        prefill.kill()
        t.join(WAIT_S)
        assert box["r"].status_code == 503, box["r"].text
        wait_for(lambda: not running(engine[0]), WAIT_S, "the engine process after SIGKILL")
        wait_for(lambda: decode.pages_used() == 0, WAIT_S, "decode pool back to zero", interval=0.1)
    finally:
        prefill.stop()
        decode.stop()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()]
