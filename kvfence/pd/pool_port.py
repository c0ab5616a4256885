"""PoolPort: the one way from a PD service's other threads (its IO loop, the transport's writer
and gather threads) into the engine's KVPool, with its threading rule checked on every call.

The rule: the engine thread owns the pool, and the one thing it leaves alone is a sequence parked
in HANDOFF. So the PD side may touch a grant's pages only while the port holds that grant: from
`hand_over` (the engine thread, in a HandoffHooks callback, the sequence just parked) until
`commit` or `release` hands it back. Engine-side calls (`hand_over`, `held_digest`) come from the
engine thread alone; PD-side calls (destination and source checks, writes, read-backs, the
transport's views of the pages) from any thread but the engine's, on a grant the port holds. A
call that breaks the rule raises PortRuleBroken, which fails the room closed (its connection's
reader drops the connection). The `skip_port_rule` fault point turns the check off (the twin).

Before the engine's loop starts and after it ends no thread owns the pool: the thread half of
the rule is moot then, the grant half still holds. Tensor parallelism: rank 0's slice mover
(pd/tp_slices.py) is reached through this port too, and the other ranks' half of its ops
(`follow`) lives here, the other module in kvfence/pd that touches a pool.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvfence.faults import Faults
from kvfence.kv.pool import Grant, KVPool, SealedReads
from kvfence.kv.prefix import Namespace, held_digest
from kvfence.model.tp import RankGroup
from kvfence.pd import kvio
from kvfence.pd.tp_slices import (
    GatherSlices,
    RankSlices,
    SliceChecksums,
    SliceOp,
    as_i64,
    recv,
    run_shape,
    send,
)

if TYPE_CHECKING:
    from kvfence.engine.engine import Engine


class PortRuleBroken(RuntimeError):
    """A pool call from a thread, or on a grant, that the port's rule forbids."""


class PoolView:
    """The pool's K/V tensors and geometry without its side tables: what a transport reads and
    writes (kvio.PageTensors). Built once per port; identity-hashed (kvio caches per view)."""

    def __init__(self, pool: KVPool) -> None:
        self.k, self.v = pool.k, pool.v
        self.page_size, self.num_layers = pool.page_size, pool.num_layers
        self.num_pages, self.device = pool.num_pages, pool.device

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size


class PoolPort:
    def __init__(self, engine: Engine, faults: Faults) -> None:
        pool = engine.pool
        self._engine, self._pool, self._faults = engine, pool, faults
        self.view = PoolView(pool)
        self.slices: RankSlices | None = None  # None: one rank holds whole pages
        if engine.tp is not None:
            from kvfence.engine.tp_runner import LeaderRunner

            assert isinstance(engine.runner, LeaderRunner)
            self.slices = RankSlices(engine.tp, engine.runner.mirror, self.view, follow)
        self._held: dict[int, Grant] = {}  # grant id -> the grant the PD side holds
        # The read-back (I3) gathers a transfer's pages on the device and syncs once: a GPU
        # pool's way, which a CPU test turns on to check that very code.
        self.batched_checksums = pool.device.type != "cpu"
        self._lock = threading.Lock()  # the engine thread adds, the PD side removes

    # ---- the rule ---------------------------------------------------------------------------

    def _check(self, call: str, engine_side: bool, grant: Grant | None = None) -> None:
        if not self._faults.guards().on("port_rule"):
            return
        loop = self._engine.loop_thread()
        here = threading.current_thread()
        if loop is not None and (here is loop) != engine_side:
            side = "the engine thread" if engine_side else "a thread other than the engine's"
            raise PortRuleBroken(f"{call} must be called from {side}, not from {here.name}")
        if grant is not None and self._held.get(grant.grant_id) != grant:
            raise PortRuleBroken(
                f"{call} on grant {grant.grant_id} (request {grant.request_id}), which the PD "
                "side does not hold: its pages are the engine's"
            )

    def holds(self, grant: Grant) -> bool:
        return self._held.get(grant.grant_id) == grant

    # ---- the engine thread ------------------------------------------------------------------

    def hand_over(self, grant: Grant) -> None:
        """The grant's sequence parked in HANDOFF: its pages are the PD side's until commit or
        release."""
        self._check("hand_over", engine_side=True)
        with self._lock:
            self._held[grant.grant_id] = grant

    def held_digest(self, pages: list[int], namespaces: bool) -> str:
        """What these cache pages hold, as the cache recorded it when they were sealed (the
        cache's bookkeeping is the engine thread's)."""
        self._check("held_digest", engine_side=True)
        prefix = self._pool.prefix
        assert prefix is not None
        entries = [prefix.entry(page) for page in pages]
        assert all(e is not None for e in entries), "a referenced page left the cache"
        return held_digest(((e.namespace, e.tokens) for e in entries if e is not None), namespaces)

    # ---- the PD side, on a grant it holds -----------------------------------------------------

    def check_destination(self, grant: Grant, pages: Sequence[int]) -> list[bool]:
        """Per page, whether grant and its tenant still own it (I2 on a transfer's write)."""
        self._check("check_destination", False, grant)
        return self._pool.check_destination(grant, pages)

    def mark_written(self, grant: Grant, pages: Sequence[int]) -> None:
        self._check("mark_written", False, grant)
        self._pool.mark_written(grant, pages)

    def write(
        self, grant: Grant, pages: list[int], n_tokens: int, data: torch.Tensor,
        which: list[int] | None,
    ) -> None:  # fmt: skip
        """This rank's slice of a run (kvio.scatter) into pages, marked written under grant."""
        self._check("write", False, grant)
        kvio.scatter(self.view, pages, n_tokens, data, which)
        self._pool.mark_written(grant, pages)

    def pages(self, grant: Grant) -> PoolView:
        """The tensors, for a transport to read or write this grant's pages with (sent from,
        decrypted into): the rule is checked here, when the pages are handed out."""
        self._check("pages", False, grant)
        return self.view

    def checksums(self, grant: Grant, pages: list[int], n_tokens: int) -> list[int]:
        """Per-page checksums of what the pool holds, over every rank's slice (I3)."""
        self._check("checksums", False, grant)
        if self.slices is not None:
            return self.slices.checksums(pages, n_tokens)
        if self.batched_checksums:
            return kvio.batched_checksums(self.view, pages, n_tokens)
        return kvio.pool_checksums(self.view, pages, n_tokens)

    def check_source(
        self, grant: Grant, pages: list[int], n_tokens: int, sealed: SealedReads | None
    ) -> bool:
        self._check("check_source", False, grant)
        return self._pool.check_source(grant, pages, n_tokens, sealed)

    def describe_owners(self, grant: Grant, pages: list[int]) -> str:
        self._check("describe_owners", False, grant)
        return self._pool.describe_owners(pages)

    # ---- handing a grant back ---------------------------------------------------------------

    def commit(self, request_id: str, grant: Grant, first_token: int, first_logprobs: dict) -> None:
        """The transfer is verified: the pages go back to the engine, which decodes on them."""
        self._check("commit", False, grant)
        self._drop(grant)
        self._engine.commit(request_id, first_token, first_logprobs)

    def release(self, request_id: str, grant: Grant | None) -> None:
        """No PD-side writer or reader of the pages remains: the engine frees them (I4). Any
        thread; a grant never handed over (a room closed while computing) has nothing to drop."""
        if grant is not None:
            self._drop(grant)
        self._engine.release(request_id)

    def _drop(self, grant: Grant) -> None:
        with self._lock:
            if self._held.get(grant.grant_id) == grant:
                del self._held[grant.grant_id]

    # ---- facts any thread may read ----------------------------------------------------------

    @property
    def has_prefix_cache(self) -> bool:
        return self._pool.prefix is not None

    def prefix_namespaces(self, tokens: list[int], ns: Namespace) -> list[Namespace]:
        """Per full page of tokens, the namespace its KV belongs to (a declared public page's
        is the shared one): a pure function of the operator's declarations."""
        prefix = self._pool.prefix
        n = len(tokens) // self.view.page_size
        return prefix.chain(tokens, ns).namespaces if prefix is not None else [ns] * n

    def sealed_reads(self, ns: Namespace, tags: list[int], namespace: bool) -> SealedReads | None:
        """One row's sealed-page read permission (SealedReads) for a transfer source: the
        keys its chain has there, in its namespace (the keyer is a pure function)."""
        prefix = self._pool.prefix
        if prefix is None:
            return None
        device = self.view.device
        return SealedReads(
            read_only=torch.ones((1, len(tags)), dtype=torch.bool, device=device),
            ns_ids=torch.tensor([prefix.namespace_id(ns)], device=device),
            key_tags=torch.tensor([tags], dtype=torch.int64, device=device),
            namespace=namespace,
        )


def follow(op: SliceOp, pool: KVPool, group: RankGroup) -> None:
    """Ranks 1..N-1 of a tensor-parallel PD role: this rank's part of one of rank 0's slice ops,
    on the rank's own thread, between two steps."""
    if isinstance(op, GatherSlices):
        send(group, kvio.gather(pool, op.pages, op.count), 0)
        return
    if isinstance(op, SliceChecksums):
        send(group, as_i64(kvio.pool_checksums(pool, op.pages, op.n_tokens)), 0)
        return
    if op.table_pages.numel():
        pool.apply_side_tables(op.table_pages, op.table_rows)
    run = recv(group, torch.empty(run_shape(pool, len(op.pages), op.count), dtype=torch.uint8), 0)
    owned = pool.check_destination(op.grant, op.pages)
    if not op.dest_check or op.leader_alone:
        owned = [True] * len(op.pages)
    mine = [i for i, ok in enumerate(owned) if ok]
    if mine:
        dst = [op.pages[i] for i in mine]
        kvio.scatter(pool, dst, op.count, run, None if len(mine) == len(owned) else mine)
        pool.mark_written(op.grant, dst)
        if op.corrupt and group.rank == group.size - 1:
            kvio.corrupt_page(pool, dst[0])
    refused = torch.tensor([not ok for ok in owned], dtype=torch.int32, device=group.device)
    group.max_(refused)
