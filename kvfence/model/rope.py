"""Rotary position embedding tables (default, linear and llama3 scaling), HF rotate-half layout;
partial rotary (GLM-4 MoE) rotates each head's first rotary_dim dims and passes the rest."""

from __future__ import annotations

import math

import torch

from kvfence.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """dim: the rotated dims per head (head_dim, or head_dim * partial_rotary_factor)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
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
    """cos/sin [positions, rotary_dim] for every position up to max_positions, computed once in
    float32."""

    def __init__(self, rope: RopeConfig, rotary_dim: int, max_positions: int, device: torch.device):
        inv = inv_frequencies(rope, rotary_dim).to(device)
        t = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos()
        self.sin = emb.sin()

    def at(self, positions: torch.Tensor) -> Rotation:
        """The rotation of a step's tokens (positions [T]), looked up once for every layer."""
        return Rotation(self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))


class Rotation:
    """cos/sin [T, 1, R] of one step's positions (R: the rotated dims per head)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated (rotate-half form over the first R dims), in float32."""
        dtype = x.dtype
        r = self.cos.shape[-1]
        xf = x.float()
        xr = xf if r == xf.shape[-1] else xf[..., :r]
        half = r // 2
        rotated = torch.cat((-xr[..., half:], xr[..., :half]), dim=-1)
        out = xr * self.cos + rotated * self.sin
        if r != xf.shape[-1]:
            out = torch.cat((out, xf[..., r:]), dim=-1)
        return out.to(dtype)
