"""The mooncake transport: prefill writes a room's pages one-sidedly into decode's registered
pool (Mooncake Transfer Engine), then sends PageRun frames that carry only the checksums.
Decode cannot veto such a write; its read-back digest at DONE (I3) and the deferred release of
aborted rooms (I4) carry the weight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvfence.kv.pool import Grant
from kvfence.pd import kvio, wire
from kvfence.pd.kvio import PageTensors
from kvfence.pd.transport.mooncake import MooncakeEndpoint
from kvfence.pd.transport.page_link import PageReceiver, PageSender, RoomSend
from kvfence.pd.transport.tcp import Connection

if TYPE_CHECKING:
    from kvfence.pd.pool_port import PoolPort

R = TypeVar("R")


class MooncakeSender(PageSender):
    backend = "mooncake"

    def __init__(self, pool: PageTensors, host: str) -> None:
        self.endpoint = MooncakeEndpoint(pool, hostname=host)
        self._remote: dict[Connection, dict] = {}  # each decode peer's pool descriptor

    def peer_joined(self, conn: Connection, info: dict[str, Any]) -> None:
        self._remote[conn] = info["mooncake"]

    def peer_left(self, conn: Connection) -> None:
        self._remote.pop(conn, None)

    async def send_room(self, job: RoomSend) -> list[tuple[int, int]] | None:
        if job.cancelled():
            return None
        # The fence: no frame of this room leaves until its writes have completed.
        writing = asyncio.get_running_loop().run_in_executor(
            None,
            self.endpoint.write_tokens,
            self._remote[job.conn],
            job.src,
            job.dst,
            job.n_tokens,
        )
        job.hold(writing)
        await writing
        # The pages went one-sidedly; frames carry their checksums, hashed in place.
        all_sums = kvio.pool_checksums(job.view, job.src, job.n_tokens)
        sums: list[tuple[int, int]] = []
        for first, n, count in job.runs:
            if job.stopped():
                return None
            run_sums = all_sums[first : first + n]
            sums += [(first + k, c) for k, c in enumerate(run_sums)]
            await job.conn.send(wire.PageRun(job.room, first, count, tuple(run_sums)))
            job.sent(n, count)
        return sums

    def close(self) -> None:
        self.endpoint.close()


class MooncakeReceiver(PageReceiver):
    backend = "mooncake"

    def __init__(self, pool: PageTensors, host: str) -> None:
        self.endpoint = MooncakeEndpoint(pool, hostname=host)

    def hello_info(self) -> dict[str, Any]:
        return {"mooncake": self.endpoint.descriptor()}

    def payload_bytes(self, pool: PageTensors, n_pages: int, n_tokens: int) -> int:
        return 0  # the bytes are already in the pool

    def apply(
        self,
        conn: Connection,
        payload: memoryview,
        write: Callable[[memoryview | None], R],
        applied: Callable[[R], None],
    ) -> asyncio.Future | None:
        # Nothing to write; the checks are cheap and the read-back digest at DONE checks bytes.
        applied(write(None))
        return None

    def committed(self, port: PoolPort, grant: Grant, pages: list[int]) -> None:
        # One-sided writes left no trace; the verified digest vouches for the pages.
        port.mark_written(grant, pages)

    def close(self) -> None:
        self.endpoint.close()
