"""Tensor-parallel model pieces: the rank group's collectives, a loaded model cut to one rank's
slice (kvfence/tp_layout.py says which), and the collectives put where a slice needs them.

Column-parallel (no communication): q/k/v and gate/up keep this rank's heads and columns.
Row-parallel: o_proj and down keep the matching input columns; their partial outputs are summed
by one all-reduce each. Vocab-parallel: the embedding looks up the ids in this rank's rows (zero
elsewhere) and all-reduces; the LM head computes this rank's logits and rank 0 gathers them.
A model with tp_size 1 never meets this module: no wrapper, no collective, no copy.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from kvfence.model.linear import Projection
from kvfence.model.llama import CausalLM
from kvfence.model.mlp import MLP
from kvfence.tp_layout import TpLayout


class RankGroup:
    """One engine's ranks over torch.distributed (gloo on CPU, NCCL on CUDA), made from a store
    without the process-global default group, so a test process may hold several engines.
    Every collective has the group's timeout: a dead or stalled rank raises, never hangs."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        connect_timeout_s: float = 600.0,
    ) -> None:
        """timeout_s bounds every collective; connect_timeout_s only the ranks' first meeting
        (a loaded machine may take long to start a process)."""
        self.rank, self.size, self.device = rank, size, device
        connect = timedelta(seconds=connect_timeout_s)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)
            self.pg: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, connect)
        timeout = timedelta(seconds=timeout_s)
        self._sum = dist.AllreduceOptions()
        self._sum.timeout = timeout
        self._max = dist.AllreduceOptions()
        self._max.reduceOp = dist.ReduceOp.MAX
        self._max.timeout = timeout
        self._gather = dist.GatherOptions()
        self._gather.rootRank = 0
        self._gather.timeout = timeout
        self._bcast = dist.BroadcastOptions()
        self._bcast.rootRank = 0
        self._bcast.timeout = timeout
        self._barrier = dist.BarrierOptions()
        self._barrier.timeout = timeout
        self._timeout = timeout
        self.comm_s = 0.0  # seconds spent in collectives (benchmarks read it)
        self.comm_calls = 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place (t must be contiguous)."""
        t0 = time.perf_counter()
        self.pg.allreduce([t], self._sum).wait()
        self.comm_s += time.perf_counter() - t0
        self.comm_calls += 1
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        self.pg.allreduce([t], self._max).wait()
        return t

    def broadcast_(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t on every rank, in place."""
        self.pg.broadcast([t], self._bcast).wait()
        return t

    def gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's t concatenated on the last dim, in rank order; others: t."""
        t0 = time.perf_counter()
        t = t.contiguous()
        outs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(outs, [t], self._gather).wait()
        self.comm_s += time.perf_counter() - t0
        self.comm_calls += 1
        return torch.cat(outs[0], dim=-1) if self.rank == 0 else t

    def send_(self, t: torch.Tensor, dst: int) -> None:
        """t (contiguous) to rank dst, which must be in the matching recv_."""
        self.pg.send([t], dst, 0).wait(self._timeout)

    def recv_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank src's matching send_, into t (contiguous, its shape and dtype)."""
        self.pg.recv([t], src, 0).wait(self._timeout)
        return t

    def barrier(self) -> None:
        self.pg.barrier(self._barrier).wait()


# ---- cutting a loaded model to one rank's slice (before fuse_projections) ----------------------


def _keep_rows(lin: nn.Linear, start: int, stop: int) -> None:
    lin.weight.data = lin.weight.data[start:stop].clone()
    if lin.bias is not None:
        lin.bias.data = lin.bias.data[start:stop].clone()


def _keep_cols(lin: nn.Linear, start: int, stop: int) -> None:
    lin.weight.data = lin.weight.data[:, start:stop].clone()


def _vocab_block(w: torch.Tensor, layout: TpLayout) -> torch.Tensor:
    start = layout.vocab_start
    n = max(0, min(layout.vocab_size, start + layout.vocab_rows) - start)
    block = torch.zeros(layout.vocab_rows, w.shape[1], dtype=w.dtype, device=w.device)
    block[:n] = w[start : start + n]
    return block


def shard_model(model: CausalLM, layout: TpLayout) -> None:
    """Keep only this rank's slice of every weight (norms stay whole). Dense layers only: the
    config check (tp_problem) refuses mixture-of-experts models first."""
    for layer in model.model.layers:
        attn = layer.self_attn
        d = attn.head_dim
        q0, q1 = layout.head_start * d, (layout.head_start + layout.num_heads) * d
        k0, k1 = layout.kv_head_start * d, (layout.kv_head_start + layout.num_kv_heads) * d
        _keep_rows(attn.q_proj, q0, q1)
        _keep_rows(attn.k_proj, k0, k1)
        _keep_rows(attn.v_proj, k0, k1)
        _keep_cols(attn.o_proj, q0, q1)
        attn.num_heads, attn.num_kv_heads = layout.num_heads, layout.num_kv_heads
        ffn = layer.ffn
        assert isinstance(ffn, MLP), "tensor parallelism splits dense MLPs only"
        c0, c1 = layout.columns(ffn.intermediate)
        gate, up, down = ffn.linears()
        _keep_rows(gate, c0, c1)
        _keep_rows(up, c0, c1)
        _keep_cols(down, c0, c1)
        ffn.intermediate = c1 - c0
    embed = model.model.embed_tokens
    embed.weight.data = _vocab_block(embed.weight.data, layout)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = embed.weight
    else:
        model.lm_head.weight.data = _vocab_block(model.lm_head.weight.data, layout)


# ---- the collectives, put in after the runner fused (and maybe packed) the projections --------


class ReducedProjection:
    """A row-parallel projection: this rank's partial product, summed over the ranks."""

    def __init__(self, inner: Projection, group: RankGroup) -> None:
        self.inner, self.group = inner, group

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        assert bias is None, "row-parallel projections here have no bias"
        return self.group.all_reduce_(self.inner(x).contiguous())

    def __getattr__(self, name: str) -> object:  # panels, nbytes() for weight_bytes()
        return getattr(self.inner, name)


def _local_ids(ids: torch.Tensor, layout: TpLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """ids as rows of this rank's block (clamped) and whether each is this rank's."""
    local = ids - layout.vocab_start
    mine = (local >= 0) & (local < layout.vocab_rows)
    return local.clamp(0, layout.vocab_rows - 1), mine


class ParallelEmbedding(nn.Module):
    def __init__(self, inner: nn.Embedding, group: RankGroup, layout: TpLayout) -> None:
        super().__init__()
        self.inner, self.group, self.layout = inner, group, layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local, mine = _local_ids(ids, self.layout)
        x = self.inner(local) * mine[:, None].to(self.inner.weight.dtype)
        return self.group.all_reduce_(x.contiguous())


class ParallelHead(nn.Module):
    """The LM head of an unpacked model: this rank's logits, gathered on rank 0."""

    def __init__(self, inner: nn.Linear, group: RankGroup, layout: TpLayout) -> None:
        super().__init__()
        self.inner, self.group, self.layout = inner, group, layout

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.gather_cat(self.inner(hidden))[..., : self.layout.vocab_size]


class ParallelPackedHead:
    """The packed LM head (and a tied embedding's rows): gathered logits, reduced lookups."""

    def __init__(self, inner: Projection, group: RankGroup, layout: TpLayout) -> None:
        self.inner, self.group, self.layout = inner, group, layout

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.gather_cat(self.inner(hidden))[..., : self.layout.vocab_size]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        local, mine = _local_ids(ids, self.layout)
        rows = self.inner.rows(local)
        x = rows * mine[:, None].to(rows.dtype)  # the head's dtype: float32 or bfloat16
        return self.group.all_reduce_(x.contiguous())

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def install_collectives(model: CausalLM, group: RankGroup, layout: TpLayout) -> None:
    """Put the all-reduces and the logits gather where this rank's slice needs them."""
    for layer in model.model.layers:
        attn, ffn = layer.self_attn, layer.ffn
        assert attn.o is not None and isinstance(ffn, MLP) and ffn.down is not None, "fuse first"
        attn.o = ReducedProjection(attn.o, group)  # type: ignore[assignment]
        ffn.down = ReducedProjection(ffn.down, group)  # type: ignore[assignment]
    if model.head is not None:
        model.head = ParallelPackedHead(model.head, group, layout)  # type: ignore[assignment]
    else:
        model.lm_head = ParallelHead(model.lm_head, group, layout)  # type: ignore[assignment]
    if not model.embeds_from_head:
        embed = model.model.embed_tokens
        model.model.embed_tokens = ParallelEmbedding(embed, group, layout)  # type: ignore[assignment]
