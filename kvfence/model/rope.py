"""Rotary position embedding tables (default, linear and llama3 scaling), HF rotate-half layout."""

from __future__ import annotations

import math

import torch

from kvfence.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.kind == "linear":
        inv = inv / rope.factor
    elif rope.kind == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv.to(torch.float32)


class RotaryTable:
    """cos/sin for every position up to max_positions, computed once in float32."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device):
        inv = inv_frequencies(rope, head_dim).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of a step's tokens (positions [T]), looked up once for every layer."""
        return Rotation(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class Rotation:
    """cos/sin [T, 1, D] of one step's positions."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated (rotate-half form), computed in float32."""
        dtype = x.dtype
        xf = x.float()
        half = xf.shape[-1] // 2
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * self.cos + rotated * self.sin).to(dtype)
