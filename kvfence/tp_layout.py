"""How a dense decoder splits over `--tp-size` ranks: which heads, KV heads, MLP columns and
vocab rows each rank holds. Plain arithmetic (no torch), shared by the sharded model
(kvfence/model/tp.py) and the pool plan (kvfence/kv/sizing.py), so preflight counts what a rank
actually allocates.

q heads split evenly; KV heads split evenly when there are at least as many as ranks, else each
rank holds the one KV head its q heads read (replicated, as vLLM and SGLang do); gate/up columns
and down rows split evenly; embedding and LM head rows split in ceil(vocab / size) blocks, the
last one padded with zero rows that are cut off the gathered logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfence.shape import ModelShape


def pd_tp_problem(tp_size: int, backend: str) -> str | None:
    """Why a PD role cannot run tensor-parallel over this transfer backend, or None. A room moves
    every rank's slice of each page through rank 0's connection (kvfence/pd/tp_slices.py);
    Mooncake's one-sided writes reach only the pool a peer registered, rank 0's slice."""
    if tp_size > 1 and backend == "mooncake":
        return (
            f"--disaggregation-transfer-backend mooncake with --tp-size {tp_size}: one-sided "
            "writes reach only rank 0's slice of each page; tensor-parallel PD workers use the "
            "tcp backend"
        )
    return None


def tp_problem(mc: ModelShape, size: int, intermediate: int | None, moe: bool) -> str | None:
    """Why this model cannot split over size ranks (one line naming the flag), or None."""
    if size < 1:
        return f"--tp-size {size}: must be >= 1"
    if size == 1:
        return None
    if moe:
        return f"--tp-size {size}: mixture-of-experts models run with --tp-size 1 only"
    if mc.num_heads % size:
        return f"--tp-size {size} does not divide num_attention_heads {mc.num_heads}"
    kv = mc.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        return f"--tp-size {size}: num_key_value_heads {kv} must divide it or be divisible by it"
    if intermediate is not None and intermediate % size:
        return f"--tp-size {size} does not divide intermediate_size {intermediate}"
    return None


@dataclass(frozen=True)
class TpLayout:
    rank: int
    size: int
    num_heads: int  # q heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int
    vocab_size: int  # the model's
    vocab_rows: int  # embedding / LM head rows per rank, padding included

    @classmethod
    def of(cls, mc: ModelShape, rank: int, size: int) -> TpLayout:
        assert 0 <= rank < size
        kv = mc.num_kv_heads
        if kv >= size:
            kv_local, kv_start = kv // size, rank * (kv // size)
        else:  # fewer KV heads than ranks: this rank's q heads all read one of them
            kv_local, kv_start = 1, rank // (size // kv)
        return cls(
            rank=rank,
            size=size,
            num_heads=mc.num_heads // size,
            num_kv_heads=kv_local,
            kv_head_start=kv_start,
            vocab_size=mc.vocab_size,
            vocab_rows=-(-mc.vocab_size // size),
        )

    @property
    def head_start(self) -> int:
        return self.rank * self.num_heads

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def columns(self, total: int) -> tuple[int, int]:
        """This rank's even share [start, stop) of total MLP columns."""
        n = total // self.size
        return self.rank * n, (self.rank + 1) * n


def replicated_extra_params(mc: ModelShape, size: int, qkv_bias: bool, tied: bool) -> int:
    """Parameters one rank holds beyond an even 1/size share of the model: replicated K/V
    projections (fewer KV heads than ranks) and the vocab padding rows. Norm weights (replicated
    too, a few KiB per layer) are left out, as the plan has always counted them split."""
    if size == 1:
        return 0
    layout = TpLayout.of(mc, 0, size)
    kv_cols = mc.head_dim * (1 + (1 if qkv_bias else 0) / mc.hidden_size)
    kv_extra = (
        2
        * mc.num_layers
        * mc.hidden_size
        * kv_cols
        * (layout.num_kv_heads - mc.num_kv_heads / size)
    )
    pad = (layout.vocab_rows - mc.vocab_size / size) * mc.hidden_size * (1 if tied else 2)
    return max(0, round(kv_extra + pad))
