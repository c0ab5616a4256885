"""RemoteRole: the RoleService the HTTP layer holds when the role runs in a process of its own.

Why a process: behind HTTP the engine's step loop and the server's event loop shared one
interpreter, so every streamed token waited for a GIL hand-off and the engine thread spent a third
of each forward off CPU (measured behind HTTP against the same engine in one process). vLLM runs
its EngineCore in its own process and SGLang its scheduler; kvfence cuts at the RoleService seam:
the child (`kvfence/role_child.py`) holds the role, its engine, its pool and (PD) its transfer
threads; this process holds the HTTP server and a tokenizer. Nothing of the pool crosses the
pipe: requests go down, each engine step's outputs come up in one message.

One pipe (a socketpair carrying pickled tuples), both ways:
  down  ("submit", call, handle, req) | ("abort", request_id) | ("call", call, name)
  up    ("ready", facts) | ("reply", call, ok, value) | ("out", [(handle, output), ...])
        | ("alive", bool)
A submit's outputs are keyed by a handle this process picks, not by request id: a duplicate id
(which the engine answers with an error) cannot take over another request's stream.

If the child dies, every stream still open ends with a 503 error, every call waiting fails, and
`alive` turns False (/health and /live say so), as when an engine thread fails closed.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from kvfence.config import NodeConfig
from kvfence.engine.admission import ENGINE_FAILED, Admitted, Rejected
from kvfence.engine.request import FinishReason, GenerateRequest, RequestOutput
from kvfence.role import TokenizerLike

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from kvfence.engine.engine import EngineStats

log = logging.getLogger(__name__)

# How long a call may wait for the child's answer. A call never waits on a step (the child's
# command thread answers between the engine's GIL releases), so this bounds a wedged child only.
CALL_TIMEOUT_S = 60.0
# After shutdown's answer (the engine stopped): how long the child gets to exit before SIGKILL.
EXIT_TIMEOUT_S = 30.0
ENGINE_GONE = "This worker's engine process exited; it serves nothing more."


class RoleStartFailed(Exception):
    """The child exited before it was ready; it printed why. `code` is its exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the engine process exited with status {code} before it was ready")
        self.code = code


class RemoteRole:
    """A RoleService whose role lives in the child process `proc`, reached through `conn`."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        conn: Connection,
        facts: dict[str, Any],
        tokenizer: TokenizerLike,
    ) -> None:
        self._proc = proc
        self._conn = conn
        self._tokenizer = tokenizer
        self.model_name: str = facts["model_name"]
        self.context_length: int = facts["context_length"]
        self.prefix_caching: bool = facts["prefix_caching"]
        self._alive: bool = facts["alive"]
        self._exited: str | None = None  # why the pipe closed, once it has
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _sinks and _calls against the reader thread
        self._sinks: dict[int, Callable[[RequestOutput], None]] = {}
        self._handles: dict[int, GenerateRequest] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._shut = False
        self._reader = threading.Thread(target=self._read, name="kvfence-role-pipe", daemon=True)
        self._reader.start()

    # ---- RoleService --------------------------------------------------------------------------

    @property
    def tokenizer(self) -> TokenizerLike:
        return self._tokenizer

    @property
    def alive(self) -> bool:
        return self._alive and self._exited is None

    def start(self) -> None:
        self._call("start")

    def stop_admitting(self) -> None:
        self._call("stop_admitting")

    def stats(self) -> EngineStats:
        return self._call("stats")

    def info(self) -> dict[str, Any]:
        return self._call("info")

    def metrics(self) -> Iterable[Metric]:
        return self._call("metrics")

    def submit(
        self, req: GenerateRequest, sink: Callable[[RequestOutput], None]
    ) -> Admitted | Rejected:
        handle = next(self._ids)
        with self._lock:  # before the request leaves: its first output may beat the reply
            if self._exited is not None:  # as an engine failed closed answers: nothing held
                return Rejected(req.request_id, ENGINE_FAILED, ENGINE_GONE, status=503)
            self._sinks[handle] = sink
            self._handles[handle] = req
        try:
            verdict = self._call("submit", handle, req)
        except BaseException:
            self._forget(handle)
            raise
        if isinstance(verdict, Rejected):
            self._forget(handle)
            return verdict
        return Admitted(req, int(verdict))

    def abort(self, request_id: str) -> None:
        if self._exited is None:
            self._send(("abort", request_id))

    def shutdown(self) -> None:
        """Stop the role (its engine finishes its step), then wait for the child to exit."""
        if self._shut:
            return
        self._shut = True
        try:
            if self._exited is None:
                self._call("shutdown")
        except RuntimeError as e:  # it died meanwhile: nothing left to stop
            log.warning("engine process shutdown: %s", e)
        try:
            self._proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("engine process did not exit within %.0f s: killing it", EXIT_TIMEOUT_S)
            self._proc.kill()
            self._proc.wait()
        self._conn.close()

    # ---- the pipe -----------------------------------------------------------------------------

    def _send(self, msg: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _call(self, name: str, *payload: Any) -> Any:
        call = next(self._ids)
        fut: Future[Any] = Future()
        with self._lock:
            if self._exited is not None:
                raise RuntimeError(f"engine process unavailable: {self._exited}")
            self._calls[call] = fut
        try:
            self._send((name, call, *payload) if name == "submit" else ("call", call, name))
        except OSError as e:
            with self._lock:
                self._calls.pop(call, None)
            raise RuntimeError(f"engine process unavailable: {e}") from e
        try:
            ok, value = fut.result(timeout=CALL_TIMEOUT_S)
        except TimeoutError:
            with self._lock:
                self._calls.pop(call, None)
            raise RuntimeError(
                f"engine process did not answer {name} in {CALL_TIMEOUT_S:.0f} s"
            ) from None
        if not ok:
            raise RuntimeError(f"engine process failed {name}: {value}")
        return value

    def _forget(self, handle: int) -> None:
        with self._lock:
            self._sinks.pop(handle, None)
            self._handles.pop(handle, None)

    def _read(self) -> None:
        """The reader thread: the child's replies and outputs, until the pipe closes."""
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "out":
                    self._deliver(msg[1])
                elif kind == "reply":
                    with self._lock:
                        fut = self._calls.pop(msg[1], None)
                    if fut is not None:
                        fut.set_result((msg[2], msg[3]))
                elif kind == "alive":
                    self._alive = bool(msg[1])
        except (EOFError, OSError) as e:
            reason = "exited" if isinstance(e, EOFError) else f"pipe failed ({e!r})"
        self._on_exit(reason)

    def _deliver(self, outputs: list[tuple[int, RequestOutput]]) -> None:
        for handle, out in outputs:
            with self._lock:
                sink = self._sinks.get(handle)
                if out.finished:
                    self._sinks.pop(handle, None)
                    self._handles.pop(handle, None)
            if sink is not None:
                sink(out)

    def _on_exit(self, reason: str) -> None:
        """The child is gone: fail every call and end every open stream (I5: one final output)."""
        code = self._proc.poll()
        why = f"the engine process {reason}" + (f" (status {code})" if code is not None else "")
        if not self._shut:
            log.error("%s; every open request fails", why)
        with self._lock:
            self._exited = why
            calls, self._calls = self._calls, {}
            open_ = [(self._sinks[h], self._handles[h]) for h in self._sinks]
            self._sinks, self._handles = {}, {}
        for fut in calls.values():
            fut.set_result((False, why))
        for sink, req in open_:
            sink(
                RequestOutput(
                    request_id=req.request_id,
                    new_token_ids=(),
                    new_text="",
                    finish_reason=FinishReason.ERROR,
                    prompt_tokens=len(req.prompt_token_ids),
                    completion_tokens=0,
                    error=ENGINE_GONE,
                    error_code=ENGINE_FAILED,
                    error_status=503,
                )
            )


def spawn_role(config: NodeConfig) -> RemoteRole:
    """Start the role of `config` in a child process and return once its engine is built: the
    NodeConfig (frozen, plain values) is the first message down the pipe, no argparse object.
    Raises RoleStartFailed with the child's exit status if it is not.
    Call it from a thread that outlives the role (the main thread): Linux's parent-death signal,
    which ties the child's life to this process, fires when the thread that spawned it ends."""
    from kvfence.model.tokenizer import load_tokenizer

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfence.role_child", str(theirs.fileno()), str(os.getpid())],
        pass_fds=(theirs.fileno(),),
    )
    theirs.close()
    conn = Connection(ours.detach())
    try:
        conn.send(config)
        kind, facts = conn.recv()
        assert kind == "ready", kind
        tokenizer = load_tokenizer(config.engine, facts["vocab_size"])
    except EOFError:
        conn.close()
        raise RoleStartFailed(proc.wait()) from None
    except BaseException:  # Ctrl-C while the model loads, or no tokenizer here: no orphan
        proc.kill()
        proc.wait()
        conn.close()
        raise
    return RemoteRole(proc, conn, facts, tokenizer)
