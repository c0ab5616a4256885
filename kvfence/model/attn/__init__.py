"""Attention backends behind one seam (backend.py), chosen per device and dtype by
`select_backend`: the native CPU kernels where they apply, flex_attention over the pool's pages
on CUDA (flex.py), else the reference gather + SDPA."""

from __future__ import annotations

import torch

from kvfence.model import kernels
from kvfence.model.attn.backend import AttentionBackend, AttentionGroup, PagedRows
from kvfence.model.attn.cpu_native import CpuNativeBackend
from kvfence.model.attn.flex import FlexBackend
from kvfence.model.attn.reference import ReferenceBackend

__all__ = ["AttentionBackend", "AttentionGroup", "PagedRows", "select_backend"]


def select_backend(
    choice: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, null_page: int
) -> AttentionBackend:
    """--attention-backend: `torch` is the reference; `auto` the device's in-place backend where
    it applies and builds here (native on CPU, flex on CUDA), else the reference; `native` the
    CPU kernels or an error; `flex` flex_attention on any device (CPU tests force it).
    dtype: the queries'; kv_dtype: the pool's."""
    reference = ReferenceBackend(device, null_page, dtype)
    if choice == "torch":
        return reference
    if choice == "flex":
        if kv_dtype != dtype:
            raise RuntimeError(
                "--attention-backend flex: the KV cache must be in the model's dtype "
                "(--kv-cache-dtype auto)"
            )
        return FlexBackend(device)
    in_place = _in_place(device, dtype, kv_dtype)
    if in_place is not None:
        return in_place
    if choice == "native":
        raise RuntimeError(
            "--attention-backend native: the kernel needs a CPU device, a KV cache in the "
            "model's dtype and a C++ toolchain (g++, ninja); see the log for the build error"
        )
    return reference


def _in_place(
    device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype
) -> AttentionBackend | None:
    if kv_dtype != dtype:
        return None
    if device.type == "cuda":
        return FlexBackend(device)
    if device.type != "cpu":
        return None
    decode, prefill = kernels.paged_decode(), kernels.paged_prefill()
    if decode is None or prefill is None:
        return None
    return CpuNativeBackend(decode, prefill)
