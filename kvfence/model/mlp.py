"""The gated SiLU MLP (dense layers, each routed expert, GLM's shared experts), its three
projections under their Hugging Face names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.model.kernels import FusedEpilogue, PackedGemm
from kvfence.model.linear import Projection, fuse_transposed

HF_NAMES = ("gate_proj", "up_proj", "down_proj")


class MLP(nn.Module):
    def __init__(
        self, hidden: int, intermediate: int, names: tuple[str, str, str] = HF_NAMES
    ) -> None:
        super().__init__()
        self.names = names  # Mixtral's experts call them w1, w3, w2
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, up, nn.Linear(hidden, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, hidden, bias=False))
        self.intermediate = intermediate
        self.gate_up: Projection | None = None  # set by fuse()
        self.down: Projection | None = None

    def linears(self) -> list[nn.Linear]:
        """The gate, up and down projections' modules."""
        return [getattr(self, n) for n in self.names]

    def projections(self) -> list[Projection | None]:
        return [self.gate_up, self.down]

    def fuse(self) -> None:
        gate, up, down = self.linears()
        self.gate_up = Projection(fuse_transposed([gate.weight, up.weight]))
        self.down = Projection(fuse_transposed([down.weight]))

    def pack(self, gemm: PackedGemm) -> None:
        for proj in self.projections():
            assert proj is not None, "fuse() before pack()"
            proj.pack(gemm)

    def forward(self, x: torch.Tensor, epilogue: FusedEpilogue | None = None) -> torch.Tensor:
        if self.gate_up is None or self.down is None:
            gate, up, down = self.linears()
            return down(F.silu(gate(x)) * up(x))
        if epilogue is not None:
            return self.down(epilogue.silu_mul(self.gate_up(x), self.intermediate))
        gate_x, up_x = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate_x).mul_(up_x))
