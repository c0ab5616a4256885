"""A PD room's KV across the ranks of a tensor-parallel engine: every rank holds its KV heads'
slice of each page, while the room travels on rank 0's one connection (one TLS session, one
pairing, the protocol unchanged).

Prefill: rank 0 gathers every rank's slice of a run's pages (`RankSlices.gather`) and sends them
as one payload, the slices one after another (kvio's layout). Decode: rank 0 writes its slice and
hands rank r its own (`scatter`); each rank checks the room's grant on its copy of the side tables
before it writes a page (I2), and every rank's refusals are combined (all-reduce MAX), so a page
one rank refused fails the room. The read-back (`checksums`) hashes each slice on the rank that
holds it and folds them per page, so decode verifies every rank's slice of every page it will
attend to (I3).

Each op is one frame down the ranks' plan pipes followed by its point-to-point transfers, all
under the leader's lock (which the step's plan and collectives also take), so every rank meets
the ops in the order the pipes carry them, between two steps. A rank lost meanwhile breaks the
group (`TpBroken`): the engine fails closed and the room with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from kvfence.engine.tp_group import RankCall, RankFn, TpBroken, TpLeader
from kvfence.kv.pool import Grant
from kvfence.model.tp import RankGroup
from kvfence.pd import kvio

if TYPE_CHECKING:
    from kvfence.engine.tp_runner import TableMirror

T = TypeVar("T")


@dataclass(frozen=True)
class GatherSlices:
    """Prefill: each rank sends rank 0 its slice of `pages` (their first `count` tokens)."""

    pages: list[int]
    count: int


@dataclass(frozen=True)
class ScatterSlices:
    """Decode: rank 0 sends each rank its slice of a run; the rank writes the pages the room's
    grant owns in its side tables (updated first with what changed on rank 0)."""

    pages: list[int]
    count: int
    grant: Grant
    table_pages: torch.Tensor
    table_rows: torch.Tensor
    dest_check: bool  # rank 0's dest_check guard: off only in that guard's twin
    corrupt: bool  # fault: the last rank scrambles its slice of the first page after writing
    leader_alone: bool  # fault twin: the ranks write what rank 0 accepted, checking nothing


@dataclass(frozen=True)
class SliceChecksums:
    """The read-back: each rank's per-page checksums of its slice of the first n_tokens."""

    pages: list[int]
    n_tokens: int


SliceOp = GatherSlices | ScatterSlices | SliceChecksums


def as_i64(sums: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.asarray(sums, dtype=np.uint64).view(np.int64).copy())


def as_u64(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.cpu().numpy().view(np.uint64)]


def run_shape(pool: kvio.PageTensors, n: int, count: int) -> tuple[int, int, int, int]:
    return (2, pool.num_layers, n, count * kvio.token_bytes(pool))


class RankSlices:
    """Rank 0's side: the ops above, each run to its end or TpBroken."""

    def __init__(
        self, leader: TpLeader, mirror: TableMirror, view: kvio.PageTensors, follow: RankFn
    ) -> None:
        """view: rank 0's pool tensors, from the pool port (pd/pool_port.py), which reaches
        this mover only for grants it holds; follow: the other ranks' part of each op (the
        port's), which the op's frame names so the engine's ranks run it knowing no role."""
        self.leader, self.mirror, self.view, self.follow = leader, mirror, view, follow
        self.group, self.size = leader.group, leader.size

    def _op(self, op: SliceOp, body: Callable[[], T]) -> T:
        with self.leader.lock:
            self.leader.send(RankCall(self.follow, op))  # TpBroken: the group is broken
            try:
                return body()
            except Exception as e:
                # The ranks are out of step now: nothing may run on this group again.
                self.leader.fail(self.leader.broken or f"moving KV slices failed ({e!r})")
                raise TpBroken(self.leader.broken or "tensor-parallel group broken") from e

    def gather(self, pages: list[int], count: int, buf: bytearray | None = None) -> torch.Tensor:
        """Every rank's slice of the pages, [ranks, 2, layers, pages, bytes], in buf when it is
        big enough."""
        shape = (self.size, *run_shape(self.view, len(pages), count))
        need = int(np.prod(shape))
        if buf is not None and len(buf) >= need:
            out = torch.frombuffer(buf, dtype=torch.uint8, count=need).view(shape)
        else:
            out = torch.empty(shape, dtype=torch.uint8)

        def body() -> torch.Tensor:
            kvio.gather(self.view, pages, count, out=out[0])
            for rank in range(1, self.size):
                recv(self.group, out[rank], rank)
            return out

        return self._op(GatherSlices(list(pages), count), body)

    def scatter(
        self,
        slices: torch.Tensor,
        pages: list[int],
        count: int,
        grant: Grant,
        dest_check: bool,
        corrupt: bool,
        leader_alone: bool = False,
    ) -> list[bool]:
        """Hand rank r its slice (slices[r - 1], [2, layers, len(pages), bytes]) of pages rank 0
        has written; per page, whether any rank refused to write it."""

        def body() -> list[bool]:
            for rank in range(1, self.size):
                send(self.group, slices[rank - 1].contiguous(), rank)
            refused = torch.zeros(len(pages), dtype=torch.int32, device=self.group.device)
            return self.group.max_(refused).bool().tolist()

        with self.leader.lock:  # the side tables' delta and the op that carries it go together
            table_pages, table_rows = self.mirror.delta()
            op = ScatterSlices(
                list(pages), count, grant, table_pages, table_rows, dest_check, corrupt,
                leader_alone,
            )  # fmt: skip
            return self._op(op, body)

    def checksums(self, pages: list[int], n_tokens: int) -> list[int]:
        """Per-page checksums of the first n_tokens of pages over every rank's slice."""
        return kvio.fold_ranks(self.rank_checksums(pages, n_tokens))

    def rank_checksums(self, pages: list[int], n_tokens: int) -> list[list[int]]:
        """Each rank's per-page checksums of its own slice, in rank order."""

        def body() -> list[list[int]]:
            per_rank = [kvio.pool_checksums(self.view, pages, n_tokens)]
            for rank in range(1, self.size):
                t = torch.empty(len(per_rank[0]), dtype=torch.int64)
                per_rank.append(as_u64(recv(self.group, t, rank)))
            return per_rank

        return self._op(SliceChecksums(list(pages), n_tokens), body)


def send(group: RankGroup, t: torch.Tensor, rank: int) -> None:
    group.send_(t.to(group.device), rank)


def recv(group: RankGroup, out: torch.Tensor, rank: int) -> torch.Tensor:
    if out.device == group.device:
        return group.recv_(out, rank)
    return out.copy_(group.recv_(torch.empty_like(out, device=group.device), rank))
