"""The engine process (`python -m kvfence.role_child FD PARENT_PID`), started by
kvfence/role_process.py.

It builds the role of the NodeConfig its parent sends (`kvfence.node.build_role`: the engine, its
pool and, in PD, the transfer threads), says "ready" and then serves the pipe on FD until its
parent asks it to shut down or goes away (a parent killed outright takes this process with it:
the parent-death signal). The pipe's messages are listed in kvfence/role_process.py.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from kvfence.config import NodeConfig
from kvfence.engine.admission import Rejected
from kvfence.engine.outbox import StepOutbox
from kvfence.engine.request import GenerateRequest, RequestOutput
from kvfence.faults import Faults
from kvfence.lifetime import die_with_parent
from kvfence.role import RoleService

# How often the command thread looks at the role's liveness when no command comes.
ALIVE_POLL_S = 0.5
# Submits run beside each other, as they did on the HTTP server's executor threads (a grammar
# compile may take a while and must not hold up aborts or other admissions).
SUBMIT_THREADS = 4


def _crash(point: str) -> None:
    """A kill_* fault point fired here: the whole worker dies as a real crash kills it, the HTTP
    process first (no error answer, no drain), then this one."""
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class Commands:
    """The command thread's side: each message from the parent, and liveness reports."""

    def __init__(self, conn: Connection, role: RoleService, send_lock: threading.Lock) -> None:
        self.conn = conn
        self.role = role
        self.lock = send_lock
        # The engine thread's outputs leave as one message a step.
        self.outbox: StepOutbox[int] = StepOutbox(self._send_outputs, send_lock)
        self.submits = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="kvfence-submit")
        self.alive = role.alive
        engine = getattr(role, "engine", None)
        if engine is not None:
            engine.step_end_hooks.append(self.outbox.step_done)

    def _send_outputs(self, batch: list[tuple[int, RequestOutput]]) -> None:
        try:
            self.conn.send(("out", batch))
        except OSError:  # the parent is gone; the command thread is ending the role
            pass

    def reply(self, call: int, ok: bool, value: Any) -> None:
        with self.lock:
            try:
                self.conn.send(("reply", call, ok, value))
            except OSError:
                pass

    def submit(self, call: int, handle: int, req: GenerateRequest) -> None:
        try:
            verdict = self.role.submit(req, self.outbox.sink(handle))
        except Exception as e:  # an engine bug: the client gets a 500, the child lives
            self.reply(call, False, repr(e))
            return
        self.reply(call, True, verdict if isinstance(verdict, Rejected) else verdict.max_tokens)

    def call(self, name: str) -> Any:
        role = self.role
        if name == "start":
            return role.start()
        if name == "stop_admitting":
            return role.stop_admitting()
        if name == "stats":
            return role.stats()
        if name == "info":
            return role.info()
        if name == "metrics":
            return list(role.metrics())
        if name == "shutdown":
            role.shutdown()
            self.outbox.flush()
            return None
        raise ValueError(f"no such call: {name}")

    def run(self) -> None:
        """Until the parent asks for shutdown or goes away."""
        while True:
            try:
                if not self.conn.poll(ALIVE_POLL_S):
                    self.report_alive()
                    continue
                msg = self.conn.recv()
            except (EOFError, OSError):
                self.role.shutdown()  # the parent died: nobody will read what the engine does
                return
            kind = msg[0]
            if kind == "abort":
                self.role.abort(msg[1])
            elif kind == "submit":
                self.submits.submit(self.submit, *msg[1:])
            else:
                _, call, name = msg
                try:
                    value = self.call(name)
                except Exception as e:
                    self.reply(call, False, repr(e))
                else:
                    self.report_alive()  # before the reply: a started role is alive when asked
                    self.reply(call, True, value)
                if name == "shutdown":
                    return
            self.report_alive()

    def report_alive(self) -> None:
        alive = self.role.alive
        if alive != self.alive:
            self.alive = alive
            with self.lock:
                self.conn.send(("alive", alive))


def main(fd: int, parent: int) -> int:
    from kvfence.node import build_role, startup_error

    # The worker is one unit: when its HTTP process dies, however it dies (SIGKILL included),
    # this one goes at once, so no engine or bootstrap listener finishes a transfer nobody
    # answers for.
    die_with_parent(parent)
    faulthandler.enable()  # a C-level crash leaves its threads' stacks in the worker's log
    # The HTTP process owns the signals: Ctrl-C reaches the whole process group, and SIGTERM's
    # drain must keep this process serving until the parent says stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    config = conn.recv()
    if not isinstance(config, NodeConfig):  # the parent sends the config, never raw flags
        raise TypeError(f"the engine process expects a NodeConfig, got {type(config).__name__}")
    faults = Faults.from_env(crash=_crash)
    try:
        role = build_role(config, faults)
    except Exception as e:
        code = startup_error(e)
        if code is None:
            raise
        return code
    send_lock = threading.Lock()
    commands = Commands(conn, role, send_lock)
    facts = {
        "model_name": role.model_name,
        "context_length": role.context_length,
        "prefix_caching": bool(getattr(role, "prefix_caching", False)),
        "vocab_size": role.tokenizer.vocab_size,
        "alive": role.alive,
    }
    with send_lock:
        conn.send(("ready", facts))
    commands.run()
    commands.submits.shutdown(wait=False, cancel_futures=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
