"""The LoRA slot table: a bounded number of adapters (--max-loras) resident on the device, one
slot each, swapped least recently used first; and each step's rows grouped by slot.

A step's rows are grouped by slot once (`LoraSlots.prepare`); every site then adds its update
with one grouped matmul pair over all the adapters of the step (kvfence/lora/grouped.py), and
the routed experts with one over every (adapter, expert) pair of the layer (`ExpertDelta`). A
slot used by the current step is never evicted, and the scheduler admits no more distinct
adapters than there are slots, so every batch fits."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.lora.checkpoint import LoraAdapter
from kvfence.lora.grouped import Groups, group_rows, grouped_delta
from kvfence.lora.sites import Site


@dataclass(frozen=True)
class LoraBatch:
    """One step's token rows grouped by slot."""

    token_slot: torch.Tensor  # [tokens] each token's slot, -1 for none
    slots: tuple[int, ...]  # the slots present, ascending: group g computes with slots[g]
    slot_index: torch.Tensor | None  # slots as a tensor; None when they are 0..max_loras-1
    groups: Groups


class SiteDelta:
    """y += (x @ A_t[slot]) @ B_t[slot] per token for one fused projection, every slot of the step
    in one grouped matmul pair: B_t holds the adapter's scaling, and its block-diagonal layout
    puts each slice's update in its own output columns. A routed-experts site holds one A and B
    per expert ([max_loras, experts, ...]) and is applied by the MoE block (`ExpertDelta`). A
    slot whose adapter skips a site holds zeros there."""

    def __init__(self, site: Site, slots: LoraSlots, a: torch.Tensor, b: torch.Tensor) -> None:
        self.site = site
        self.slots = slots
        self.a = a  # [max_loras, (experts,) in, width]
        self.b = b  # [max_loras, (experts,) width, out]
        self.active = [False] * a.shape[0]  # whether the slot's adapter targets this site

    def any_active(self, batch: LoraBatch) -> bool:
        return any(self.active[s] for s in batch.slots)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        batch = self.slots.batch
        if batch is None or not self.any_active(batch):
            return
        a, b = self.a, self.b
        if batch.slot_index is not None:
            a, b = a.index_select(0, batch.slot_index), b.index_select(0, batch.slot_index)
        y.add_(grouped_delta(x, a, b, batch.groups))


class ExpertDelta:
    """The routed experts' updates of one MoE layer. Its rows are (token, expert) assignments
    sorted by expert; they are grouped by (slot, expert), and each of gate_up and down runs one
    grouped matmul pair over the pairs present, with their A and B gathered."""

    def __init__(self, gate_up: SiteDelta, down: SiteDelta) -> None:
        self.gate_up, self.down = gate_up, down
        self.experts = gate_up.site.experts

    def plan(self, token_of_row: torch.Tensor, expert_of_row: torch.Tensor) -> Groups | None:
        batch = self.gate_up.slots.batch
        if batch is None or not (self.gate_up.any_active(batch) or self.down.any_active(batch)):
            return None
        slot = batch.token_slot.index_select(0, token_of_row)
        key = torch.where(slot >= 0, slot * self.experts + expert_of_row, -1)
        return group_rows(key, self.gate_up.a.shape[0] * self.experts)

    def apply(self, which: SiteDelta, x: torch.Tensor, g: Groups) -> torch.Tensor:
        """[rows, out] updates of `which` (self.gate_up or self.down) for the rows `x`."""
        a = which.a.flatten(0, 1).index_select(0, g.keys)
        b = which.b.flatten(0, 1).index_select(0, g.keys)
        return grouped_delta(x, a, b, g)


class LoraSlots:
    """max_loras slots on `device`, each holding one adapter's weights at every site."""

    def __init__(
        self, sites: list[Site], max_loras: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.max_loras = max_loras
        self.deltas: dict[str, SiteDelta] = {}
        for s in sites:
            w, lead = s.width(max_rank), (max_loras, s.experts) if s.experts else (max_loras,)
            a = torch.zeros(*lead, s.in_dim, w, dtype=dtype, device=device)
            b = torch.zeros(*lead, w, s.out_dim, dtype=dtype, device=device)
            self.deltas[s.key] = SiteDelta(s, self, a, b)
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
        groups = group_rows(token_slot, self.max_loras)
        assert groups is not None
        slots = tuple(groups.keys.tolist())
        device = next(iter(self.deltas.values())).a.device
        self.batch = LoraBatch(
            token_slot.to(device),
            slots,
            None if slots == tuple(range(self.max_loras)) else groups.keys.to(device),
            _to(groups, device),
        )

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
        for key, delta in self.deltas.items():
            laid = adapter.sites.get(key)
            delta.active[slot] = laid is not None
            if laid is None:  # zeros: a batched step may still multiply this slot at this site
                delta.a[slot].zero_()
                delta.b[slot].zero_()
            else:
                delta.a[slot].copy_(laid[0])
                delta.b[slot].copy_(laid[1])  # the scaling is folded in
        self.swaps += 1


def _to(g: Groups, device: torch.device) -> Groups:
    spread = None if g.spread is None else g.spread.to(device)
    return Groups(g.keys.to(device), g.gather.to(device), spread, g.zero_row)
