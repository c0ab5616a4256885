"""The mixture-of-experts block: a router per family and the experts, batched over tokens.

A step's (token, expert) assignments are sorted by expert once; each active expert then runs
one gate_up and one down matmul over its contiguous rows, and the weighted outputs are gathered
back to token-major order and summed over the top-k. Python loops are over active experts and
over k, never over tokens.
Module names mirror Hugging Face's checkpoints (per-expert `experts.{e}.{gate,up,down}`); after
fuse() the per-expert weights are views of one stacked, transposed tensor per kind.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.model.kernels import FusedEpilogue, PackedGemm
from kvfence.model.linear import Projection
from kvfence.model.mlp import MLP
from kvfence.model.moe_config import MoeConfig

if TYPE_CHECKING:
    from kvfence.lora.slots import ExpertDelta


class Router(nn.Module):
    """`gate.weight` [E, hidden] (and GLM's `gate.e_score_correction_bias`): token -> top_k
    experts and their weights, as transformers' router of each family computes them."""

    def __init__(self, hidden: int, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, experts [T, k] int64)."""
        m = self.moe
        if m.scoring == "softmax":
            probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
            weights, experts = torch.topk(probs, m.top_k, dim=-1)
            if m.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, experts
        # Sigmoid scores; choice by score + correction bias within the best topk_group groups.
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if m.n_group > 1:
            grouped = choice.view(-1, m.n_group, m.num_experts // m.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        experts = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, experts


class SparseMoE(nn.Module):
    """router `gate`, routed `experts`, and GLM's always-on `shared_experts`."""

    def __init__(self, hidden: int, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(hidden, moe)
        self.experts = nn.ModuleList(
            MLP(hidden, moe.expert_intermediate_size, moe.expert_names)
            for _ in range(moe.num_experts)
        )
        self.shared_experts: MLP | None = None
        if moe.shared_intermediate_size:
            self.shared_experts = MLP(hidden, moe.shared_intermediate_size)
        self.inter = moe.expert_intermediate_size
        # Set by fuse(): stacked W^T [E, hidden, 2I] and [E, I, hidden]; one Projection per
        # expert over its slice (packed per expert by pack()).
        self.gate_up_t: torch.Tensor | None = None
        self.down_t: torch.Tensor | None = None
        self.expert_projs: list[tuple[Projection, Projection]] = []
        self.lora: ExpertDelta | None = None  # the routed experts' LoRA (kvfence/lora/apply.py)

    def fuse(self) -> None:
        gate_up, down = [], []
        for e in self.experts:
            g, u, d = e.linears()
            gate_up += [g.weight, u.weight]
            down.append(d.weight)
        n, h, i = len(self.experts), self.gate.weight.shape[1], self.inter
        self.gate_up_t = _stack_transposed(gate_up, n, h, 2 * i)
        self.down_t = _stack_transposed(down, n, i, h)
        self.expert_projs = [
            (Projection(self.gate_up_t[k]), Projection(self.down_t[k])) for k in range(n)
        ]
        if self.shared_experts is not None:
            self.shared_experts.fuse()

    def projections(self) -> list[Projection | None]:
        shared = self.shared_experts.projections() if self.shared_experts is not None else []
        return [p for pair in self.expert_projs for p in pair] + shared

    def linears(self) -> list[nn.Linear]:
        shared = self.shared_experts.linears() if self.shared_experts is not None else []
        return [lin for e in self.experts for lin in e.linears()] + shared

    def pack(self, gemm: PackedGemm) -> None:
        """Each expert's projections into the packed kernel's panels; the stacked tensors go."""
        for p in self.projections():
            assert p is not None, "fuse() before pack()"
            p.pack(gemm)
        self.gate_up_t = self.down_t = None

    def forward(self, x: torch.Tensor, epilogue: FusedEpilogue | None = None) -> torch.Tensor:
        t, h = x.shape
        weights, experts = self.gate(x)
        k = experts.shape[1]
        # Each token's experts in ascending order, so its sum below runs in the order
        # transformers' loop over experts adds them (the same bits, not just close).
        experts, perm = experts.sort(dim=1)
        weights = weights.gather(1, perm)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, expert) rows grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()  # one host sync
        rows = order // k
        xs = x.index_select(0, rows)
        ex = self.lora
        plan = None if ex is None else ex.plan(rows, flat.index_select(0, order))
        gate_up_delta = None if ex is None or plan is None else ex.apply(ex.gate_up, xs, plan)
        outs, hs, start = [], [], 0
        for e, n in enumerate(counts):
            if n:
                d = None if gate_up_delta is None else gate_up_delta[start : start + n]
                outs.append(self._expert(e, xs[start : start + n], epilogue, d, hs))
                start += n
        grouped = outs[0] if len(outs) == 1 else torch.cat(outs)
        if ex is not None and plan is not None:
            grouped = grouped + ex.apply(ex.down, torch.cat(hs), plan)
        # Back to token-major rows (a gather, not a scatter-add: index_add_ on CPU wakes the
        # thread pool for a few rows, which dominated a loaded machine's decode profile).
        w = weights if not self.moe.weights_in_input_dtype else weights.to(x.dtype)
        parts = grouped.index_select(0, torch.argsort(order)).view(t, k, h) * w.unsqueeze(-1)
        y = parts[:, 0].to(x.dtype)
        for j in range(1, k):  # top_k adds of [T, hidden]: a loop over k, not over tokens
            y = y + parts[:, j].to(x.dtype)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x, epilogue)
        return y

    def _expert(
        self, e: int, x: torch.Tensor, epilogue: FusedEpilogue | None,
        gate_up_delta: torch.Tensor | None = None, hs: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Expert e over its rows; with LoRA, its gate_up update added before the activation
        and the down projection's input kept in `hs` for the down update."""
        if not self.expert_projs:  # unfused: the HF-named modules
            return self.experts[e](x)
        gate_up, down = self.expert_projs[e]
        g = gate_up(x)
        if gate_up_delta is not None:
            g.add_(gate_up_delta)
        if epilogue is not None:
            h = epilogue.silu_mul(g, self.inter)
        else:
            gate, up = g.chunk(2, dim=-1)
            h = F.silu(gate).mul_(up)
        if gate_up_delta is not None and hs is not None:
            hs.append(h)
        return down(h)


def _stack_transposed(
    weights: list[nn.Parameter], n: int, rows: int, cols: int
) -> torch.Tensor:
    """One contiguous [n, rows, cols] tensor: expert k's slice is the transpose of its weights
    concatenated by output rows; each weight becomes a (strided) view of it, so HF names still
    load and save and memory stays the same."""
    per = len(weights) // n
    first = weights[0]
    stacked = torch.empty(n, rows, cols, dtype=first.dtype, device=first.device)
    for k in range(n):
        col = 0
        for w in weights[k * per : (k + 1) * per]:
            m = w.shape[0]
            stacked[k, :, col : col + m] = w.detach().t()
            w.data = stacked[k, :, col : col + m].t()
            col += m
    return stacked
