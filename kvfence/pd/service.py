"""What both PD services are built of, once: the engine (its thread owns the pool), the pool port
(the only way into the pool from any other thread), the IO loop (the room table and the
connections run there, one thread), the pairing facts, the transfer counters and the rooms'
clock. DecodeService and PrefillService add their room table and their connections.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import Metric

from kvfence.config import EngineConfig
from kvfence.engine.engine import Engine
from kvfence.faults import Faults
from kvfence.pd.ioloop import IOLoop
from kvfence.pd.peers import PeerSetup, check_setup, pairing_facts
from kvfence.pd.pool_port import PoolPort
from kvfence.pd.stats import TransferStats
from kvfence.pd.tls import TlsConfig
from kvfence.pd.transport.page_link import PageReceiver, PageSender
from kvfence.pd.transport.tcp import LinkLimits
from kvfence.role import EngineRole

# How often the room table looks for rooms past their deadline.
TICK_S = 0.5


class PdService(EngineRole):
    role: str  # "prefill" or "decode": the TLS role, the pairing facts' and the metrics' label
    link: PageSender | PageReceiver
    pairing: dict[str, Any]  # the I7 facts this worker pairs on

    def __init__(
        self,
        cfg: EngineConfig,
        backend: str,
        tls: TlsConfig | None,
        faults: Faults | None,
        timeout_s: float,
        limits: LinkLimits | None,
    ) -> None:
        self.faults = faults if faults is not None else Faults()
        self.tls = check_setup(cfg, backend, tls, self.role)  # I8: mutual TLS, this role's cert
        super().__init__(Engine(cfg, self.faults, hooks=self))
        self.engine.scheduler.share_prompts(hold_tpot=self._holds_tpot(cfg))
        self.pool_port = PoolPort(self.engine, self.faults)  # this service's only way in
        self.slices = self.pool_port.slices  # None: one rank holds whole pages
        self.limits = limits or LinkLimits()
        self.timeout_s = timeout_s
        self.backend = backend
        self.transfer_stats = TransferStats(self.role)
        self.io = IOLoop(f"kvfence-{self.role}-io")
        self.loop = self.io.loop

    def _holds_tpot(self, cfg: EngineConfig) -> bool:
        """Whether this role's steps hold the TPOT target over their prefill floors: a decode
        worker that takes prompts (DecodeService)."""
        return False

    def _peer_setup(self, cfg: EngineConfig) -> PeerSetup:
        """What the connections are made with; the I7 facts this worker pairs on become
        self.pairing (HELLO adds what the transport needs)."""
        self.pairing = pairing_facts(self.engine, self.pool_port.view, self.role, cfg, self.backend)
        return PeerSetup(
            self.tls, self.faults, self.timeout_s, self.limits, self.pairing, self.transfer_stats
        )

    # ---- lifecycle (the caller's thread) ------------------------------------------------------

    def start(self) -> None:
        self.engine.start()
        self.io.on_stop(self._close_all)
        self.io.start(self._begin())

    def shutdown(self) -> None:
        self.io.stop()
        self.link.close()
        self.engine.shutdown()

    async def _begin(self) -> None:
        """On the IO loop, before start() returns: the connections' set-up, then the clock."""
        asyncio.ensure_future(self._clock())

    async def _clock(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            self._tick(time.monotonic())

    def _tick(self, now: float) -> None:
        """Rooms past their deadline, connections idle too long (the IO loop)."""

    def _close_all(self) -> None:
        """The IO loop is stopping: close every connection."""

    # ---- what the HTTP layer reads ------------------------------------------------------------

    def metrics(self) -> Iterable[Metric]:
        return self.transfer_stats.metrics(self.engine.stats().pages_handoff)

    def _info(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "model": self.engine.model_name,
            "context_length": self.engine.context_length,
            "page_size": self.pool_port.view.page_size,
            "counters": self.transfer_stats.snapshot(),
            "transfer_marks": self.transfer_stats.marks(),
        }
