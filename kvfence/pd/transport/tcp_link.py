"""The tcp transport: page bytes ride in the PageRun frames' payloads on the TLS connection, and
decode writes them into its pool itself (so it can refuse any write).

Sender: each run (with tensor parallelism, every rank's slice of it) is gathered into one of two
reused buffers and hashed on a thread while the previous run is being encrypted and sent: one
contiguous SSL_write per run (a page's blocks are a few KiB, and one TLS record and syscall per
block would cost more than the gather).
Receiver: a run's checksums, grant check and writes run on one writer thread while the loop
receives the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvfence.kv.pool import Grant, KVPool
from kvfence.pd import kvio, wire
from kvfence.pd.transport.link import PageReceiver, PageSender, RoomSend
from kvfence.pd.transport.tcp import Connection

R = TypeVar("R")


class TcpSender(PageSender):
    backend = "tcp"
    # Over TLS, runs of 1 MiB pipeline: run i + 1 is gathered and hashed while run i is
    # encrypted, and decode checks and writes run i while run i + 1 is decrypted. One 8 MiB run
    # serialised them (2 shared cores, in-process sweep, best of 8: 8 MiB 39 ms, 1 MiB 23 ms,
    # 512 KiB 23 ms, 256 KiB 31 ms, 128 KiB 46 ms per 8 MiB prompt; see benchmarks/RESULTS.md).
    run_bytes = 1 << 20

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []  # gather buffers, reused across rooms
        # Gathers and checksums of the next run while the loop sends the current one.
        self._gather = ThreadPoolExecutor(1, thread_name_prefix="kvfence-prefill-kv")

    def peer_joined(self, conn: Connection, info: dict[str, Any]) -> None:
        pass  # the bytes go on the connection itself: nothing to learn of the peer

    def peer_left(self, conn: Connection) -> None:
        pass

    async def send_room(self, job: RoomSend) -> list[tuple[int, int]] | None:
        pool, runs = job.pool, job.runs
        loop = asyncio.get_running_loop()
        bufs: list[bytearray] = []  # this room's gather buffers, two while runs overlap
        pending: asyncio.Future | None = None  # the next run's gather and checksums
        sums: list[tuple[int, int]] = []
        try:
            ranks = 1 if job.slices is None else job.slices.size
            size = ranks * max(self.run_bytes, *(kvio.payload_size(pool, c) for _, _, c in runs))
            for _ in range(2):
                fits = [b for b in self._bufs if len(b) >= size]
                if fits:
                    self._bufs.remove(fits[0])
                bufs.append(fits[0] if fits else bytearray(size))
            for i, (first, n, count) in enumerate(runs):
                # send() returns once the bytes are in the kernel: the pages or the buffer are
                # free again then. job.hold keeps the pages held until every read of them is
                # over, should the room be released meanwhile.
                if pending is None:
                    pending = self._prepare(job, i, bufs)
                job.hold(pending)
                payload, run_sums = await pending
                pending = None
                if job.stopped():
                    return None
                if i + 1 < len(runs):
                    pending = self._prepare(job, i + 1, bufs)
                sending = loop.create_future()
                held = [f for f in (pending, sending) if f is not None]
                job.hold(asyncio.gather(*held, return_exceptions=True))
                sums += [(first + k, c) for k, c in enumerate(run_sums)]
                try:
                    await job.conn.send(
                        wire.PageRun(job.room, first, count, tuple(run_sums)), payload
                    )
                finally:
                    sending.set_result(None)
                job.sent(n, count)
            return sums
        finally:
            if pending is not None and not pending.done():
                # A gather is still writing into one of them: reuse them once it is over.
                pending.add_done_callback(lambda _f, b=bufs: self._bufs.extend(b))
            else:
                self._bufs.extend(bufs)

    def _prepare(self, job: RoomSend, i: int, bufs: list[bytearray]) -> asyncio.Future:
        """Run i's payload and per-page checksums, on the gather thread (numpy and xxhash
        release the GIL over whole blocks, so the loop keeps sending): a copy in bufs[i % 2]."""
        pool = job.pool
        first, n, count = job.runs[i]
        pages = job.src[first : first + n]

        def work() -> tuple[wire.Payload, list[int]]:
            if job.slices is None:
                data = kvio.gather(pool, pages, count, bufs[i % 2])
            else:  # rank 0 collects the other ranks' slices (pd/tp_slices.py)
                data = job.slices.gather(pages, count, bufs[i % 2])
            sums = kvio.run_checksums(data)
            if first == 0 and job.corrupt:
                data.view(-1)[0] ^= 0xFF  # after checksumming: the receiver must notice
            return memoryview(data.numpy()).cast("B"), sums

        return asyncio.get_running_loop().run_in_executor(self._gather, work)

    def close(self) -> None:
        self._gather.shutdown(wait=True)


class TcpReceiver(PageReceiver):
    backend = "tcp"

    def __init__(self) -> None:
        # One thread, so a connection's runs land in order; numpy and xxhash release the GIL
        # over whole blocks, so the loop keeps receiving.
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvfence-decode-kv")

    def hello_info(self) -> dict[str, Any]:
        return {}

    def payload_bytes(self, pool: KVPool, n_pages: int, n_tokens: int) -> int:
        return n_pages * kvio.payload_size(pool, n_tokens)

    def apply(
        self,
        conn: Connection,
        payload: memoryview,
        write: Callable[[memoryview | None], R],
        applied: Callable[[R], None],
    ) -> asyncio.Future | None:
        buf = conn.keep()  # the payload stays ours until the writer is done with it
        # Handed to the writer now, not from a task: the loop may read several buffered frames
        # before it next yields, and the writer would sit idle meanwhile.
        written = asyncio.get_running_loop().run_in_executor(self._writer, write, payload)

        async def finish() -> None:
            try:
                result = await written
            finally:
                if buf is not None:
                    conn.give_back(buf)
            applied(result)

        return asyncio.ensure_future(finish())

    def committed(self, pool: KVPool, pages: list[int], grant: Grant) -> None:
        pass  # every page was written here, under the grant check, and marked written then

    def close(self) -> None:
        self._writer.shutdown(wait=True)
