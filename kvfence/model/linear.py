"""A projection's weight in the layout its matmul reads, and the matmul.

- plain: W^T [in, out] contiguous, `x @ w_t` (MKL on CPU, cuBLAS on GPU). MKL beats
  `F.linear(x, w)` for decode's few rows (0.65-0.7x the time at 1-32 rows on a 135M model).
- packed: column panels for the native kernel (kernels/packed_gemm.cpp), which streams each
  panel once with the rows' sums in registers: float32 [P, in, width], 0.5-1.0x MKL's time at
  1-32 rows on cold weights, equal for prefill (benchmarks/RESULTS.md, "Kernels"); bfloat16
  [P, ceil(in / 2), width, 2], in's values in pairs for the host's bf16 dot products.

- onednn: bf16 on CPU, W reordered once into oneDNN's blocked layout, so each call skips the
  reorder `x @ W^T` pays on every call (most of a decode step's matmul time at few rows).

Packing replaces the plain tensor (memory stays the same up to one panel's padding per
weight); a packed projection can still hand out rows of W for a tied embedding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfence.model.kernels import PackedGemm


def onednn_prepacks(linear_backend: str, cpu: bool, bf16: bool, native: bool) -> bool:
    """Whether the projections take oneDNN's reordered weights (CausalLM.prepack_onednn): bf16 on
    a CPU where the packed kernel does not run bf16 (`native`: it does) and oneDNN is built in.
    The one rule the runner packs by and the preflight counts a tied head's copy by."""
    return (
        linear_backend == "auto"
        and cpu
        and bf16
        and not native
        and torch.backends.mkldnn.is_available()
    )


def to_panels(w_t: torch.Tensor, width: int) -> torch.Tensor:
    """[in, out] -> [ceil(out / width), in, width] for float32; for bfloat16
    [ceil(out / width), ceil(in / 2), width, 2], panel p's row j holding each column's
    (w[2j], w[2j + 1]). The last panel's extra columns and an odd in's last pair's second value
    are zero."""
    k, n = w_t.shape
    p = -(-n // width)
    if w_t.dtype != torch.bfloat16:
        padded = torch.zeros(k, p * width, dtype=w_t.dtype)
        padded[:, :n] = w_t
        return padded.view(k, p, width).permute(1, 0, 2).contiguous()
    k2 = -(-k // 2)
    padded = torch.zeros(2 * k2, p * width, dtype=w_t.dtype)
    padded[:k, :n] = w_t
    return padded.view(k2, 2, p, width).permute(2, 0, 3, 1).contiguous()


def fuse_transposed(weights: list[torch.nn.Parameter]) -> torch.Tensor:
    """One contiguous [in, sum(out)] tensor holding the weights, transposed; each weight becomes
    a (strided) view of it, so HF names still load and save and memory stays the same.

    `x @ w_t` beats `F.linear(x, w)` on CPU for the small-M matmuls of decode (MKL here: 0.65-0.7x
    the time for batch 1-32 on three of the four shapes of a 135M model; equal for prefill)."""
    fused_t = torch.cat([w.detach() for w in weights], dim=0).t().contiguous()
    col = 0
    for w in weights:
        n = w.shape[0]
        w.data = fused_t[:, col : col + n].t()
        col += n
    return fused_t


class Projection:
    """y = x @ W^T for one (possibly fused) weight W [out, in]."""

    def __init__(self, w_t: torch.Tensor) -> None:
        self.w_t: torch.Tensor | None = w_t  # [in, out]
        self.k, self.n = w_t.shape
        self.panels: torch.Tensor | None = None
        self.gemm: PackedGemm | None = None
        self.onednn: torch.Tensor | None = None  # set by prepack_onednn(): an opaque mkldnn tensor
        # A LoRA site's update, added to the base output in place (kvfence/lora/slots.py).
        self.lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def pack(self, gemm: PackedGemm) -> None:
        assert self.w_t is not None and self.w_t.device.type == "cpu"
        assert self.w_t.dtype == torch.float32 or (self.w_t.dtype == torch.bfloat16 and gemm.bf16)
        self.panels = to_panels(self.w_t, gemm.width)
        self.gemm = gemm
        self.w_t = None

    def prepack_onednn(self) -> None:
        assert self.w_t is not None and self.w_t.device.type == "cpu"
        self.onednn = torch.ops.mkldnn._reorder_linear_weight(self.w_t.t().contiguous(), None)
        self.w_t = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.onednn is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")
        elif self.panels is None:
            assert self.w_t is not None
            y = x @ self.w_t if bias is None else torch.addmm(bias, x, self.w_t)
        else:
            assert self.gemm is not None
            y = self.gemm.matmul(x.contiguous(), self.panels, self.n, bias)
        if self.lora is not None:
            self.lora(x, y)
        return y

    def nbytes(self) -> int:
        t = self.onednn if self.onednn is not None else self.panels
        t = self.w_t if t is None else t
        assert t is not None
        return t.numel() * t.element_size()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W [out, in] (an embedding lookup when W is a tied LM head)."""
        assert self.onednn is None, "oneDNN's layout gives no rows back: embed from the table"
        if self.panels is None:
            assert self.w_t is not None
            return self.w_t.t().index_select(0, ids)
        assert self.gemm is not None
        width = self.gemm.width
        rows = self.panels[ids // width, :, ids % width]  # [ids, in] or [ids, in / 2, 2]
        return rows.reshape(len(ids), -1)[:, : self.k]
