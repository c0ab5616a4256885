"""The model runner on each rank of a tensor-parallel engine, and where the ranks agree.

Rank 0's `LeaderRunner` decides: before each step's ownership check it ships a `StepPlan` (the
rows, what changed in the pool's side tables since the last step, the sealed-read facts and its
guard switch) to every other rank. Each `FollowerRunner` applies the side-table changes, so page
ids, grants, owners and written-by are the same tensors on every rank, and runs the same check on
its own copy. The fail flags are then combined (all-reduce MAX) and every rank drops the same rows
and runs the same forward: if any rank sees a bad page, no rank runs that row (I2 across ranks).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvfence.engine.runner import ModelRunner, StepResult
from kvfence.engine.scheduler import ScheduledChunk
from kvfence.kv.pool import Grant, KVPool, SealedReads
from kvfence.model.tp import RankGroup

Row = tuple[int, int, bool, list[int], list[int], int, int, tuple[int, int]]
# start, length, samples, pages, the chunk's tokens, grant id, tenant id, scored positions


@dataclass
class StepPlan:
    """What rank 0 sends each rank for one step (pickled over the rank's pipe)."""

    rows: list[Row]
    table_pages: torch.Tensor  # pages whose side-table entries changed since the last plan
    table_rows: torch.Tensor  # [5, len(table_pages)] their new values (KVPool.side_tables order)
    sealed: SealedReads | None  # CPU tensors
    enforce: bool  # rank 0's tag_check guard: every rank drops failed rows, or none does
    leader_alone: bool  # fault twin: rank 0's flags decide alone (SGLang #39729's pattern)
    check_only: bool = False  # the check alone, no forward (decode's commit probe)


def agree(group: RankGroup, flags: torch.Tensor, leader_alone: bool) -> torch.Tensor:
    """The batch's fail flags as every rank will act on them: any rank's flag fails the row."""
    t = flags.to(torch.int32).contiguous()
    if leader_alone:
        group.broadcast_(t)
    else:
        group.max_(t)
    return t.bool()


class TableMirror:
    """Rank 0's record of the side tables the other ranks hold, to send only what changed."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.sent = pool.side_tables()

    def delta(self) -> tuple[torch.Tensor, torch.Tensor]:
        now = self.pool.side_tables()
        changed = (now != self.sent).any(dim=0).nonzero().flatten()
        self.sent = now
        return changed.cpu(), now[:, changed].cpu()


def _cpu_sealed(s: SealedReads | None) -> SealedReads | None:
    if s is None:
        return None
    return replace(s, read_only=s.read_only.cpu(), ns_ids=s.ns_ids.cpu(), key_tags=s.key_tags.cpu())


class LeaderRunner(ModelRunner):
    """Rank 0: the engine's runner; each ownership check first sends the step to the ranks.
    A step (plan, check, forward) holds the group's lock: a PD room's slice ops
    (kvfence/pd/tp_slices.py) come from other threads and must not interleave with it."""

    def __init__(
        self, *args: Any, group: RankGroup, send: Any, lock: threading.RLock, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.send = send  # StepPlan -> None: writes it to every other rank
        self.lock = lock
        self.mirror = TableMirror(self.pool)  # read and advanced only under the lock
        self._enforce = True
        self._forward_follows = False  # inside run(): the ranks run the forward after the check

    def run(self, chunks: list[ScheduledChunk]) -> StepResult:
        with self.lock:
            self._forward_follows = True
            try:
                return super().run(chunks)
            finally:
                self._forward_follows = False

    def check_ownership(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[list[ScheduledChunk], list[ScheduledChunk]]:
        with self.lock:
            return super().check_ownership(chunks)

    def ownership_flags(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        inputs = self.ownership_inputs(chunks)
        self._enforce = super().enforce_tag_check()
        alone = self.faults.hook("tp_leader_decides_alone", False)
        pages, rows = self.mirror.delta()
        self.send(
            StepPlan(
                rows=[
                    (
                        c.start,
                        c.length,
                        c.samples,
                        list(c.seq.pages),
                        c.seq.token_ids[c.start : c.start + c.length],
                        c.seq.grant.grant_id,
                        c.seq.grant.tenant_id,
                        c.scored,
                    )
                    for c in chunks
                ],
                table_pages=pages,
                table_rows=rows,
                sealed=_cpu_sealed(inputs[5]),
                enforce=self._enforce,
                leader_alone=alone,
                check_only=not self._forward_follows,
            )
        )
        local = self.pool.check_owned(*inputs)
        local = self.faults.hook("tp_rank_skips_tag_check", local)
        return agree(self.group, local, alone)

    def enforce_tag_check(self) -> bool:
        return self._enforce


class _ChunkTokens:
    """The one slice of a sequence's tokens a rank's step reads."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, s: slice) -> list[int]:
        assert s.start == self.start and s.stop == self.start + len(self.tokens)
        return self.tokens


@dataclass
class _RankSeq:
    pages: list[int]
    token_ids: _ChunkTokens
    grant: Grant
    chain: None = None
    matcher: None = None


@dataclass
class _RankChunk:
    """What the runner reads of a ScheduledChunk, rebuilt from a plan row."""

    seq: _RankSeq
    start: int
    length: int
    samples: bool
    scored: tuple[int, int]


class FollowerRunner(ModelRunner):
    """Ranks 1..N-1: apply rank 0's plan, check, agree, run the same forward; never sample."""

    def __init__(self, *args: Any, group: RankGroup, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.plan: StepPlan | None = None
        self.scores_here = False  # its logits are a vocab slice; rank 0 scores

    def step(self, plan: StepPlan) -> None:
        if plan.table_pages.numel():
            self.pool.apply_side_tables(plan.table_pages, plan.table_rows)
        self.plan = plan
        chunks: Sequence[Any] = [
            _RankChunk(
                _RankSeq(pages, _ChunkTokens(start, toks), Grant(g, t, "")), start, n, s, scored
            )
            for start, n, s, pages, toks, g, t, scored in plan.rows
        ]
        kept, _ = self.check_ownership(list(chunks))
        if kept and not plan.check_only:
            self.forward(kept)

    def ownership_flags(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        assert self.plan is not None
        local = self.pool.check_owned(*self.ownership_inputs(chunks))
        local = self.faults.hook("tp_rank_skips_tag_check", local)
        return agree(self.group, local, self.plan.leader_alone)

    def enforce_tag_check(self) -> bool:
        assert self.plan is not None
        return self.plan.enforce

    def _sealed_reads(
        self, chunks: list[ScheduledChunk], width: int, cols: torch.Tensor
    ) -> SealedReads | None:
        assert self.plan is not None
        s = self.plan.sealed
        if s is None:
            return None
        d = self.device
        return replace(
            s, read_only=s.read_only.to(d), ns_ids=s.ns_ids.to(d), key_tags=s.key_tags.to(d)
        )
