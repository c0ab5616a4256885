"""Transfer statistics of a PD worker, rendered into the worker's /metrics at scrape time."""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MARKED_ROOMS = 256  # rooms whose phase timestamps /pd/info keeps (the newest ones)

# name -> help of the per-room phase histograms, beside the RESERVE-to-DONE one.
PHASES = {
    "send": "prefill: from sending a room's first page to queueing its DONE (gather, checksums, "
    "frames or one-sided writes)",
    "receive": "decode: from a room's first page frame to the end of its DONE handling "
    "(checks, writes into the pool, read-back digest)",
}


@dataclass
class _Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, BUCKETS), "+Inf"), self.counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


@dataclass
class TransferStats:
    role: str
    counters: dict[str, int] = field(default_factory=dict)
    _transfer: _Histogram = field(default_factory=_Histogram)
    _phases: dict[str, _Histogram] = field(default_factory=dict)
    # room -> phase -> CLOCK_MONOTONIC seconds, which every process on the host shares: a window
    # that starts in prefill and ends in decode is the difference of the two workers' marks.
    # Prefill: send_start, source_checked (I2 on the source), pages_sent, done_queued; decode:
    # first_page (the first run in), done_arrived, read_back (I3's digest), done_handled.
    _marks: OrderedDict[str, dict[str, float]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def inc(self, name: str, by: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + by

    def get(self, name: str) -> int:
        return self.counters.get(name, 0)

    def observe_latency(self, seconds: float) -> None:
        with self._lock:
            self._transfer.observe(seconds)

    def observe_phase(self, phase: str, seconds: float) -> None:
        assert phase in PHASES, phase
        with self._lock:
            self._phases.setdefault(phase, _Histogram()).observe(seconds)

    def mark(self, room: str, what: str, at: float | None = None) -> float:
        """Stamp a room's phase with time.monotonic() (or `at`); the first stamp of a phase wins."""
        t = time.monotonic() if at is None else at
        with self._lock:
            marks = self._marks.get(room)
            if marks is None:
                marks = self._marks[room] = {}
                while len(self._marks) > MARKED_ROOMS:
                    self._marks.popitem(last=False)
            return marks.setdefault(what, t)

    def marks(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {room: dict(m) for room, m in self._marks.items()}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def metrics(self, held_pages: int) -> Iterator:
        with self._lock:
            counters = dict(self.counters)
            transfer = _Histogram(list(self._transfer.counts), self._transfer.total)
            phases = {k: _Histogram(list(h.counts), h.total) for k, h in self._phases.items()}
        for name, value in sorted(counters.items()):
            yield CounterMetricFamily(
                f"kvfence_pd_{name}", f"PD {self.role}: {name.replace('_', ' ')}.", value=value
            )
        yield transfer.family(
            "kvfence_pd_transfer_seconds", f"PD {self.role}: RESERVE to DONE, per room."
        )
        for phase, hist in sorted(phases.items()):
            yield hist.family(f"kvfence_pd_{phase}_seconds", f"PD {PHASES[phase]}, per room.")
        if counters.get("prompt_tokens"):
            # prefill: prompt tokens it did not compute; decode: prompt tokens not transferred.
            yield GaugeMetricFamily(
                "kvfence_pd_prefix_hit_rate",
                f"PD {self.role}: share of prompt tokens served from this worker's prefix cache.",
                value=counters.get("prefix_cached_tokens", 0) / counters["prompt_tokens"],
            )
        yield GaugeMetricFamily(
            "kvfence_pd_pages_held",
            "Pages held for a transfer or its deferred release.",
            value=held_pages,
        )
