"""The decoder-only transformer for Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm) and the
mixture-of-experts families (Mixtral, Qwen3-MoE, GLM-4 MoE: a layer's MLP is then the expert
block of kvfence/model/moe.py; GLM-4 MoE adds partial rotary).

Module names mirror Hugging Face's so checkpoints load by name. K/V live in the KV pool, never
in the model: every forward takes the step's AttentionMetadata and each layer's (k, v) cache
views, and knows nothing of the pool or of pages' owners.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvfence.model.attention import AttentionMetadata, paged_attention
from kvfence.model.config import ModelConfig
from kvfence.model.kernels import FusedEpilogue, PackedGemm
from kvfence.model.linear import Projection, fuse_transposed
from kvfence.model.mlp import MLP
from kvfence.model.moe import SparseMoE
from kvfence.model.rope import RotaryTable, Rotation


def _fuse_rows(params: list[nn.Parameter]) -> torch.Tensor:
    """One [sum(rows), cols] tensor holding the params' rows; each param becomes a view of it."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    row = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[row : row + n]
        row += n
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op, the same bits as the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # transformers' order: normalise in float32, round, then scale by the weight in x's
        # dtype; the fused op gives the formula's bits (x * rsqrt(mean(x^2) + eps)) in two ops
        # fewer, which is most of a bf16 decode step's norm time at a few rows.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, mc: ModelConfig) -> None:
        super().__init__()
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
        # Set by fuse(): q/k/v as one matmul, o_proj on its own.
        self.qkv: Projection | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.o: Projection | None = None

    def fuse(self) -> None:
        """Concatenate q/k/v weights into one transposed tensor and make the per-name parameters
        views of it: HF names still load and save, memory stays the same, and a step does one
        matmul."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv = Projection(fuse_transposed([p.weight for p in projs]))
        if self.q_proj.bias is not None:
            self.qkv_bias = _fuse_rows([p.bias for p in projs])  # type: ignore[misc]
        self.o = Projection(fuse_transposed([self.o_proj.weight]))

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rot: Rotation,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rope_store: Callable | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv is not None:
            qkv = self.qkv(x, self.qkv_bias)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        k_cache, v_cache = kv_cache
        v = qkv[:, nq + nkv :].view(t, self.num_kv_heads, self.head_dim)
        if rope_store is not None:  # one native pass: q out, rotated k and v into their slots
            q = rope_store(qkv, rot.cos, rot.sin, self.num_heads, k_cache, v_cache,
                           meta.slot_mapping)
            k = v = None
        elif self.qk_norm:
            q = rot(self.q_norm(qkv[:, :nq].view(t, self.num_heads, self.head_dim)))
            k = rot(self.k_norm(qkv[:, nq : nq + nkv].view(t, self.num_kv_heads, self.head_dim)))
        else:  # q and k rotated by one set of ops (they are adjacent columns of qkv)
            qk = rot(qkv[:, : nq + nkv].view(t, self.num_heads + self.num_kv_heads, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        o = o.reshape(t, -1)
        return self.o(o) if self.o is not None else self.o_proj(o)


FFN = MLP | SparseMoE


class DecoderLayer(nn.Module):
    def __init__(self, mc: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(mc)
        ffn: FFN
        if mc.moe is not None and mc.is_sparse(index):
            ffn, self.ffn_name = SparseMoE(mc.hidden_size, mc.moe), mc.moe.block_name
        else:
            ffn, self.ffn_name = MLP(mc.hidden_size, mc.intermediate_size), "mlp"
        setattr(self, self.ffn_name, ffn)  # under its HF name: Mixtral's is block_sparse_moe
        self.input_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(mc.hidden_size, mc.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rot: Rotation,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, rot, kv_cache)
        return x + self.ffn(self.post_attention_layernorm(x))

    @property
    def ffn(self) -> FFN:
        """The dense MLP or the expert block, whatever the checkpoint calls it."""
        return getattr(self, self.ffn_name)

    def forward_fused(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        meta: AttentionMetadata,
        rot: Rotation,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        ep: FusedEpilogue,
        rope_store: Callable | None,
    ) -> torch.Tensor:
        """forward() with each residual add folded into the next norm: x (the residual stream,
        updated in place) still owes the previous layer's `delta`; returns this layer's."""
        attn_in, post = self.input_layernorm, self.post_attention_layernorm
        h = ep.add_rms_norm(x, delta, attn_in.weight, attn_in.eps)
        o = self.self_attn(h, meta, rot, kv_cache, rope_store)
        h = ep.add_rms_norm(x, o, post.weight, post.eps)
        return self.ffn(h, ep)


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
        self.head: Projection | None = None  # set by pack_projections(): the packed LM head
        self.epilogue: FusedEpilogue | None = None  # set by use_epilogue()
        self.rope_store: Callable | None = None  # set by use_epilogue() where it applies

    def fuse_projections(self) -> None:
        """q/k/v and gate/up become one matmul each (weights shared with the HF-named params)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.ffn.fuse()

    def pack_projections(self, gemm: PackedGemm) -> None:
        """Every projection and the LM head move into the packed kernel's column panels (after
        fuse_projections; float32, or bfloat16 where the kernel runs it). The HF-named weights
        are released, so memory stays the same: a tied embedding then reads its rows from the
        packed head."""
        for layer in self.model.layers:
            attn, ffn = layer.self_attn, layer.ffn
            for proj in (attn.qkv, attn.o):
                assert proj is not None, "fuse_projections() before pack_projections()"
                proj.pack(gemm)
            ffn.pack(gemm)
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *ffn.linears()):
                _release(m.weight)
        self.head = Projection(self.lm_head.weight.detach().t())
        self.head.pack(gemm)
        _release(self.lm_head.weight)  # the embedding's too when tied

    def prepack_onednn(self) -> None:
        """bf16 on a CPU without bf16 dot products: the attention projections, dense MLPs and
        the LM head reordered once for oneDNN (after fuse_projections); the HF-named weights are
        released as pack_projections() releases them. A tied head is reordered into a copy of
        its own (vocab x hidden x 2 bytes more: 57 MB for SmolLM-135M, a fifth of its weights):
        the embedding keeps the plain rows it looks up (oneDNN's layout gives no rows back), and
        the head no longer changes layout at every call (3.4x its time at one row)."""
        for layer in self.model.layers:
            attn, ffn = layer.self_attn, layer.ffn
            for proj in (attn.qkv, attn.o):
                assert proj is not None, "fuse_projections() before prepack_onednn()"
                proj.prepack_onednn()
            released = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            if isinstance(ffn, MLP):
                for proj in ffn.projections():
                    assert proj is not None
                    proj.prepack_onednn()
                released += ffn.linears()
            for m in released:
                _release(m.weight)
        self.head = Projection(self.lm_head.weight.detach().t())
        self.head.prepack_onednn()
        if not self.config.tie_word_embeddings:
            _release(self.lm_head.weight)

    def use_epilogue(self, ep: FusedEpilogue, kv_dtype: torch.dtype) -> None:
        """Norms, residual adds and silu * up run as the native kernels (after fuse_projections;
        float32 or bfloat16 weights), and so do rope and the K/V cache write where they are one
        pass: a cache of the weights' dtype, no q/k norm (Qwen3's stays on torch's path) and
        whole-head rotary (GLM-4 MoE's partial rotary does too)."""
        dtype = self.model.norm.weight.dtype
        assert dtype in (torch.float32, torch.bfloat16), dtype
        assert self.model.layers[0].self_attn.qkv is not None, "fuse_projections() first"
        self.epilogue = ep
        mc = self.config
        exact = kv_dtype == dtype and not mc.qk_norm and mc.rotary_dim == mc.head_dim
        self.rope_store = ep.rope_store if exact else None

    @property
    def embeds_from_head(self) -> bool:
        """A tied embedding's rows are read from the packed head (its only copy)."""
        return (
            self.head is not None
            and self.config.tie_word_embeddings
            and self.head.onednn is None
        )

    def projections(self) -> list[Projection]:
        """The fused projections a forward calls (after fuse_projections): the LM head once
        packed or prepacked, then each layer's qkv, o and FFN ones."""
        out = [self.head] + [
            p
            for layer in self.model.layers
            for p in (layer.self_attn.qkv, layer.self_attn.o, *layer.ffn.projections())
        ]
        return [p for p in out if p is not None]

    def weight_bytes(self) -> int:
        """Bytes of weights a forward reads (a tied embedding once)."""
        tensors = {id(t): t for t in self.parameters() if t.numel()}
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        return total + sum(
            p.nbytes()
            for p in self.projections()
            if p.panels is not None or p.onednn is not None
        )

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        mc = self.config
        self.rope = RotaryTable(mc.rope, mc.rotary_dim, max_positions, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. kv_caches[i]: layer i's (k, v) cache,
        each [slots, kv_heads, head_dim]; this step's K/V are written at meta.slot_mapping."""
        assert self.rope is not None, "init_rope() before forward"
        if self.embeds_from_head:
            x = self.head.rows(input_ids)  # type: ignore[union-attr]
        else:
            x = self.model.embed_tokens(input_ids)
        rot = self.rope.at(meta.positions)
        ep = self.epilogue
        if ep is None:
            for layer, kv in zip(self.model.layers, kv_caches, strict=True):
                x = layer(x, meta, rot, kv)
            return self.model.norm(x)
        # x is this forward's own fresh tensor (an embedding lookup), so it may be updated in place.
        x, delta = x.contiguous(), None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            delta = layer.forward_fused(x, delta, meta, rot, kv, ep, self.rope_store)
        norm = self.model.norm
        return ep.add_rms_norm(x, delta, norm.weight, norm.eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden).float()
        return self.lm_head(hidden).float()


def _release(p: nn.Parameter) -> None:
    """Drop a weight whose values now live elsewhere (name and dtype stay)."""
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
