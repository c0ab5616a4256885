"""Rank 0's side of a tensor-parallel engine: it starts ranks 1..N-1 as child processes, joins
them in one process group, sends each step's plan down each child's stdin pipe, and watches them.

Why pipes for the plan: a rank waits for the next step for as long as the engine is idle, which
no collective timeout may bound; a pipe waits forever and ends (EOF) when rank 0 dies, so an
orphaned rank exits on its own. The collectives (the flags' agreement, the model's all-reduces)
carry the group's timeout. A child that exits is seen at once by a watchdog thread (`proc.wait`);
one that stalls makes the next collective raise within `--tp-timeout`. Either way the group is
broken for good: the engine fails every request closed and reports itself dead (engine.py).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from kvfence.config import EngineConfig
from kvfence.model.tp import RankGroup
from kvfence.tp_layout import TpLayout

if TYPE_CHECKING:
    from kvfence.kv.pool import KVPool

log = logging.getLogger("kvfence.tp")
_LEN = struct.Struct("<Q")
STARTUP_TIMEOUT_S = 600.0  # a rank's python start and slice load (not a collective's bound)


@dataclass(frozen=True)
class RankSetup:
    """What a child rank needs to build its slice (the first frame on its stdin)."""

    cfg: EngineConfig
    rank: int
    store_path: str
    pool_pages: int
    context_length: int
    kv_cache_dtype: str
    threads: int


RankFn = Callable[[Any, "KVPool", RankGroup], None]


@dataclass(frozen=True)
class RankCall:
    """Work a role asks of ranks 1..N-1 between two steps (a PD room's KV slices): `fn(arg,
    pool, group)` on each. `fn` is a module-level function of the role, pickled by name, so the
    engine's ranks run it without importing any role."""

    fn: RankFn
    arg: Any


def write_frame(out: IO[bytes], payload: bytes) -> None:
    out.write(_LEN.pack(len(payload)))
    out.write(payload)
    out.flush()


def read_frame(src: IO[bytes]) -> Any | None:
    """The next pickled object, or None at end of file (rank 0 is gone)."""
    head = src.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    (n,) = _LEN.unpack(head)
    body = src.read(n)
    if len(body) < n:
        return None
    return pickle.loads(body)


def rank_device(device: str, rank: int) -> torch.device:
    """cpu for every rank; cuda[:k] puts rank r on device k + r."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", (d.index or 0) + rank)


def rank_threads(cfg: EngineConfig) -> int:
    """Each rank's share of the engine's cores (--threads, else every core)."""
    total = cfg.threads if cfg.threads is not None else (os.cpu_count() or 1)
    return max(1, total // cfg.tp_size)


class TpBroken(RuntimeError):
    """A rank died or stalled: the group cannot run another step."""


class TpLeader:
    def __init__(
        self,
        cfg: EngineConfig,
        layout_of: Callable[[int], TpLayout],
        pool_pages: int,
        context_length: int,
        kv_cache_dtype: str,
    ) -> None:
        self.size = cfg.tp_size
        self.layout = layout_of(0)
        self.broken: str | None = None
        # Held while a frame goes down the pipes and until its collectives are over (a step, or
        # a PD room's slice op from a transfer thread), so every rank meets them in pipe order.
        self.lock = threading.RLock()
        self.on_broken: Callable[[], None] = lambda: None  # the engine wakes its loop
        self._closing = False
        self._dir = tempfile.mkdtemp(prefix="kvfence-tp-")
        store_path = str(Path(self._dir) / "store")
        threads = rank_threads(cfg)
        self._prev_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, self.size):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvfence.engine.tp_worker"], stdin=subprocess.PIPE
                )
                self.procs.append(proc)
                setup = RankSetup(
                    cfg, rank, store_path, pool_pages, context_length, kv_cache_dtype, threads
                )
                assert proc.stdin is not None
                write_frame(proc.stdin, pickle.dumps(setup))
            for rank, proc in enumerate(self.procs, 1):
                threading.Thread(
                    target=self._watch,
                    args=(rank, proc),
                    name=f"kvfence-tp-watch-{rank}",
                    daemon=True,
                ).start()
            self.store = dist.FileStore(store_path, self.size)
            # Starting python and loading a slice take longer than a collective may: the ranks
            # say they are up through the store, so --tp-timeout bounds only the collectives.
            self._await_ranks("joining")
            self.group = RankGroup(
                self.store, 0, self.size, rank_device(cfg.device, 0), cfg.tp_timeout
            )
        except BaseException:
            self.close()
            raise

    def _await_ranks(self, stage: str) -> None:
        """Every child rank has set `stage` in the store; a child that exits first ends the wait
        (the watchdog), and so does STARTUP_TIMEOUT_S."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank in range(1, self.size):
            while True:
                try:
                    self.store.wait([f"{stage}{rank}"], timedelta(seconds=1))
                    break
                except RuntimeError:  # not yet
                    if self.broken is not None:
                        raise TpBroken(self.broken) from None
                    if time.monotonic() > deadline:
                        raise TpBroken(
                            f"rank {rank} not {stage} after {STARTUP_TIMEOUT_S:g} s"
                        ) from None

    def ready(self) -> None:
        """Every rank has built its slice (bounded by STARTUP_TIMEOUT_S, not --tp-timeout)."""
        self._await_ranks("built")

    def send(self, plan: object) -> None:
        if self.broken is not None:
            raise TpBroken(self.broken)
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, proc in enumerate(self.procs, 1):
            assert proc.stdin is not None
            try:
                write_frame(proc.stdin, payload)
            except (BrokenPipeError, OSError) as e:
                self.fail(f"tensor-parallel rank {rank} is gone ({e})")
                raise TpBroken(self.broken) from e

    def fail(self, reason: str) -> None:
        """The group is broken for good; stop the ranks that remain (they may sit in a
        collective that will never complete)."""
        if self.broken is None:
            self.broken = reason
            log.error("tensor-parallel group broken: %s; failing the engine closed", reason)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        self.on_broken()

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        if not self._closing:
            self.fail(f"tensor-parallel rank {rank} exited with status {code}")

    def close(self) -> None:
        """Stop the ranks: EOF on each pipe ends its loop; one that does not end is killed."""
        self._closing = True
        for proc in self.procs:
            if proc.stdin is not None:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        torch.set_num_threads(self._prev_threads)
        shutil.rmtree(self._dir, ignore_errors=True)
