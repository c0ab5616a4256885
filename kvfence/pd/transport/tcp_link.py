"""The tcp transport: page bytes ride in the PageRun frames' payloads on the TLS connection, and
decode writes them into its pool itself (so it can refuse any write).

A CPU pool (the common case) moves each byte once per side beside the cipher:
- sender: a run is hashed in place, then encrypted straight from its pages (pool views; no
  gather copy, no thread hand-off: on a few shared cores the hand-offs cost more than they hid);
- receiver: decode checks the run's destination pages (I2) with its header, decrypts the payload
  straight into them (Connection.recv's Placement; no buffer, no scatter) and hashes each block
  as it lands, while it is in cache; the per-page checksums are compared once the run is in, and
  DONE's read-back (I3) is unchanged.
A GPU pool, tensor parallelism (rank 0 sends every rank's slice of a run: pd/tp_slices.py)
and the corrupt_page fault take the buffered way: each run gathered into a reused
buffer and hashed on a thread while the previous one is sent; decode checks and scatters each
run on one writer thread while the loop receives the next. So does a run with a page that is
not the room's, whose other pages are written and that one refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvfence.kv.pool import Grant
from kvfence.pd import kvio, wire
from kvfence.pd.kvio import PageTensors
from kvfence.pd.transport.page_link import PageReceiver, PageSender, RoomSend
from kvfence.pd.transport.tcp import Connection

if TYPE_CHECKING:
    from kvfence.pd.pool_port import PoolPort

R = TypeVar("R")


class TcpSender(PageSender):
    backend = "tcp"
    # Runs of 1 MiB: a run hashed in place is still in cache when it is encrypted, and the
    # buffered way pipelines across runs (one 8 MiB run serialised it: 2 shared cores,
    # in-process sweep, best of 8: 8 MiB 39 ms, 1 MiB 23 ms, 512 KiB 23 ms, 256 KiB 31 ms,
    # 128 KiB 46 ms per 8 MiB prompt).
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
        if not job.view.k.is_cuda and not job.corrupt and job.slices is None:
            return await self._send_in_place(job)
        return await self._send_gathered(job)

    async def _send_in_place(self, job: RoomSend) -> list[tuple[int, int]] | None:
        """A CPU pool's runs go out as they lie in it: each run hashed in place, then
        encrypted straight from its pages (still in cache from the hashing)."""
        loop = asyncio.get_running_loop()
        sums: list[tuple[int, int]] = []
        for first, n, count in job.runs:
            if job.stopped():
                return None
            pages = job.src[first : first + n]
            run_sums = kvio.run_pool_checksums(job.view, pages, count)
            # The pages are read until send() returns (the bytes are in the kernel then);
            # job.hold keeps them held that long, should the room be released meanwhile.
            sending = loop.create_future()
            job.hold(sending)
            try:
                await job.conn.send(
                    wire.PageRun(job.room, first, count, tuple(run_sums)),
                    kvio.pool_blocks(job.view, pages, count),
                )
            finally:
                sending.set_result(None)
            sums += [(first + k, c) for k, c in enumerate(run_sums)]
            job.sent(n, count)
        return sums

    async def _send_gathered(self, job: RoomSend) -> list[tuple[int, int]] | None:
        """Each run gathered into a buffer and hashed on a thread while the previous one is
        sent (a GPU pool, every rank's slice under tensor parallelism, or the corrupt_page
        fault, which flips a byte of the copy)."""
        pool, runs = job.view, job.runs
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
        pool = job.view
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

    def payload_bytes(self, pool: PageTensors, n_pages: int, n_tokens: int) -> int:
        return n_pages * kvio.payload_size(pool, n_tokens)

    def place(self, pool: PageTensors, pages: list[int], n_tokens: int) -> list[memoryview] | None:
        # A CPU pool takes the plaintext in place: no buffer, no scatter pass, no writer thread.
        return None if pool.k.is_cuda else kvio.pool_blocks(pool, pages, n_tokens, merge=False)

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

    def committed(self, port: PoolPort, grant: Grant, pages: list[int]) -> None:
        pass  # every page was written here, under the grant check, and marked written then

    def close(self) -> None:
        self._writer.shutdown(wait=True)
