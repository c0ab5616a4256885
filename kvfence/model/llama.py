"""The decoder-only transformer for Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

Module names mirror Hugging Face's so checkpoints load by name. K/V live in the KVPool, never
in the model; every forward takes the step's AttentionMetadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.kv.pool import KVPool
from kvfence.model.attention import AttentionMetadata, paged_attention
from kvfence.model.config import ModelConfig
from kvfence.model.rope import RotaryTable


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class Attention(nn.Module):
    def __init__(self, mc: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            mc.num_heads,
            mc.num_kv_heads,
            mc.head_dim,
        )
        h = mc.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=mc.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=mc.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=mc.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        if mc.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, mc.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, mc.rms_norm_eps)
        self.qk_norm = mc.qk_norm
        self.scale = self.head_dim**-0.5

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, rope: RotaryTable, pool: KVPool
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, meta.positions)
        o = paged_attention(q, k, v, pool.k[self.layer], pool.v[self.layer], meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(mc.hidden_size, mc.intermediate_size, bias=False)
        self.up_proj = nn.Linear(mc.hidden_size, mc.intermediate_size, bias=False)
        self.down_proj = nn.Linear(mc.intermediate_size, mc.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(mc, layer)
        self.mlp = MLP(mc)
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, meta: AttentionMetadata, rope: RotaryTable, pool: KVPool
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, rope, pool)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(mc.vocab_size, mc.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(mc, i) for i in range(mc.num_layers))
        self.norm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)


class CausalLM(nn.Module):
    """model.* and lm_head.* exactly as in the HF checkpoints of the supported architectures."""

    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
        self.config = mc
        self.model = DecoderModel(mc)
        self.lm_head = nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
        if mc.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryTable | None = None

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        mc = self.config
        self.rope = RotaryTable(mc.rope, mc.head_dim, max_positions, device)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, pool: KVPool
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        assert self.rope is not None, "init_rope() before forward"
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, meta, self.rope, pool)
        return self.model.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
