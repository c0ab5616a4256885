"""The LoRA slot table: a bounded number of adapters (--max-loras) resident on the device, one
slot each, swapped least recently used first; and each step's rows grouped by slot.

A step's rows are sorted by slot once (`LoraSlots.prepare`); every site then runs, per adapter
present, one A and one B matmul over that adapter's contiguous rows (`SiteDelta`): a loop over
the adapters in the batch, never over rows. A slot used by the current step is never evicted, and
the scheduler admits no more distinct adapters than there are slots, so every batch fits."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.lora.checkpoint import LoraAdapter
from kvfence.lora.sites import Site


@dataclass(frozen=True)
class LoraBatch:
    """One step's token rows that carry an adapter, grouped by slot."""

    rows: torch.Tensor  # int64 token indices, sorted by slot
    segments: tuple[tuple[int, int, int], ...]  # (slot, start, end) into rows


class SiteDelta:
    """y[rows] += ((x[rows] @ A_t[slot]) @ B_t[slot]) * scaling[slot] for one fused projection:
    the block-diagonal B_t puts each slice's update in its own output columns."""

    def __init__(self, site: Site, slots: LoraSlots, a: torch.Tensor, b: torch.Tensor) -> None:
        self.site = site
        self.slots = slots
        self.a = a  # [max_loras, in, rank * slices]
        self.b = b  # [max_loras, rank * slices, out]
        self.active = [False] * a.shape[0]  # whether the slot's adapter targets this site

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        batch = self.slots.batch
        if batch is None:
            return
        xs = x.index_select(0, batch.rows)
        for slot, start, end in batch.segments:
            if self.active[slot]:
                d = (xs[start:end] @ self.a[slot]) @ self.b[slot]
                y.index_add_(0, batch.rows[start:end], d.mul_(self.slots.scaling[slot]))


class LoraSlots:
    """max_loras slots on `device`, each holding one adapter's weights at every site."""

    def __init__(
        self, sites: list[Site], max_loras: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.deltas: dict[str, SiteDelta] = {}
        for s in sites:
            r = max_rank * len(s.slices)
            a = torch.zeros(max_loras, s.in_dim, r, dtype=dtype, device=device)
            b = torch.zeros(max_loras, r, s.out_dim, dtype=dtype, device=device)
            self.deltas[s.key] = SiteDelta(s, self, a, b)
        self.scaling = [0.0] * max_loras
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # digest -> slot, LRU first
        self._held: list[LoraAdapter | None] = [None] * max_loras
        self.batch: LoraBatch | None = None
        self.swaps = 0

    def nbytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in self.deltas.values())

    def resident(self) -> list[str]:
        """Digests of the adapters in slots, least recently used first."""
        return list(self._slot_of)

    def prepare(self, adapters: Sequence[LoraAdapter | None], lengths: torch.Tensor) -> None:
        """This step's rows: adapters[i] applies to the lengths[i] tokens of chunk i."""
        used = {a.digest: a for a in adapters if a is not None}
        if not used:
            self.batch = None
            return
        slot = self._activate(list(used.values()))
        row_slot = torch.tensor([-1 if a is None else slot[a.digest] for a in adapters])
        token_slot = torch.repeat_interleave(row_slot, lengths)
        order = torch.argsort(token_slot, stable=True)
        counts = torch.bincount(token_slot + 1, minlength=self.max_loras + 1).tolist()
        base = counts[0]
        segments, start = [], 0
        for s, n in enumerate(counts[1:]):
            if n:
                segments.append((s, start, start + n))
                start += n
        device = next(iter(self.deltas.values())).a.device
        self.batch = LoraBatch(order[base:].to(device), tuple(segments))

    def _activate(self, adapters: list[LoraAdapter]) -> dict[str, int]:
        """Each adapter's slot, loading those not resident into the least recently used slots
        this step does not need."""
        if len(adapters) > self.max_loras:
            raise RuntimeError(f"{len(adapters)} adapters in one step, {self.max_loras} slots")
        needed = {a.digest for a in adapters}
        for a in adapters:
            if a.digest in self._slot_of:
                self._slot_of.move_to_end(a.digest)
                continue
            if len(self._slot_of) < self.max_loras:
                slot = next(i for i, h in enumerate(self._held) if h is None)
            else:
                victim = next(d for d in self._slot_of if d not in needed)
                slot = self._slot_of.pop(victim)
            self._load(slot, a)
            self._slot_of[a.digest] = slot
        return {a.digest: self._slot_of[a.digest] for a in adapters}

    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        self._held[slot] = adapter  # its weights stay alive while it is resident
        self.scaling[slot] = adapter.scaling
        for key, delta in self.deltas.items():
            laid = adapter.sites.get(key)
            delta.active[slot] = laid is not None
            if laid is not None:
                delta.a[slot].copy_(laid[0])
                delta.b[slot].copy_(laid[1])
        self.swaps += 1
