"""How many tokens a node's KV pool holds, whether one full-context request fits.

Pure arithmetic over a model's shape (kvfence.shape.ModelShape: the numbers of a config.json,
which kvfence.model.config.ModelConfig provides) and flag values; the engine and `kvfence
preflight` share it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfence.config import EngineConfig
from kvfence.lora.sites import slot_table_bytes
from kvfence.shape import ModelShape
from kvfence.tp_layout import replicated_extra_params

ROLES = ("unified", "prefill", "decode")

_DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    # One byte per element; fp8 scales are per tensor or per head and too small to plan for.
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8": 1,
}
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
# Element sizes of the dtype tags a safetensors header may carry.
_SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_SAFETENSORS_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (torch-style, with common aliases; fp8 counts as 1)."""
    key = name.removeprefix("torch.").lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[key]


def resolve_kv_dtype(dtype: str, kv_cache_dtype: str) -> str:
    """The KV dtype actually stored: "auto" means the model dtype. Resolved here only; the
    engine stores what its plan says."""
    return dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def kv_heads_per_rank(mc: ModelShape, tp_size: int = 1) -> int:
    return math.ceil(mc.num_kv_heads / tp_size)


def kv_bytes_per_token(mc: ModelShape, kv_dtype: str, tp_size: int = 1) -> int:
    """Bytes one token's K and V take on one rank, over all layers.

    2 (K and V) * layers * ceil(kv_heads / tp) * head_dim * dtype bytes. KV heads split across
    tensor-parallel ranks, but when tp_size > num_kv_heads each rank still needs one whole head, so
    heads are replicated and the per-rank cost stops falling (ceil, not division).
    """
    if tp_size < 1:
        raise ValueError(f"--tp-size {tp_size}: must be >= 1")
    per_rank = kv_heads_per_rank(mc, tp_size)
    return 2 * mc.num_layers * per_rank * mc.head_dim * dtype_bytes(kv_dtype)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors shards, each counted once."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({d / name for name in weight_map.values()})
    files = sorted(d.glob("*.safetensors"))
    # Mistral repos ship consolidated.safetensors next to the HF shards: same weights twice.
    hf = [f for f in files if not f.name.startswith("consolidated")]
    return hf or files


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: safetensors header of {n} bytes is implausible")
        return json.loads(f.read(n))


def checkpoint_weight_bytes(model_dir: str | Path, dtype: str) -> int | None:
    """On-disk tensor sizes converted to `dtype`, from headers only (no tensor is read).

    Floating tensors are counted at the target dtype, others (int, bool) as stored. None when the
    directory has no safetensors files.
    """
    files = safetensors_files(model_dir)
    if not files:
        return None
    target = dtype_bytes(dtype)
    total = 0
    for path in files:
        for name, info in _header(path).items():
            if name == "__metadata__":
                continue
            numel = math.prod(info["shape"])
            tag = info["dtype"]
            if tag not in _SAFETENSORS_BYTES:
                raise ValueError(
                    f"{path}: tensor {name!r} has dtype {tag}, which kvfence cannot size"
                )
            total += numel * (target if tag in _SAFETENSORS_FLOAT else _SAFETENSORS_BYTES[tag])
    return total


def _weight_bytes(
    mc: ModelShape, dtype: str, tp_size: int, model_dir: str | Path | None
) -> tuple[int, str]:
    """Weight bytes on one rank and where they came from: the checkpoint's headers when there
    are any, else mc.num_params. Divided evenly by tp_size; replicated norms are too small to
    matter."""
    total = checkpoint_weight_bytes(model_dir, dtype) if model_dir is not None else None
    source = "safetensors"
    if total is None:
        total, source = mc.num_params * dtype_bytes(dtype), "config"
    return math.ceil(total / tp_size) + _replicated_bytes(mc, dtype, tp_size), source


def _replicated_bytes(mc: ModelShape, dtype: str, tp_size: int) -> int:
    """What a rank of a dense model holds beyond its even share (kvfence/tp_layout.py):
    K/V projections replicated when there are fewer KV heads than ranks, vocab padding rows."""
    if tp_size == 1 or getattr(mc, "moe", None) is not None:
        return 0  # mixture-of-experts models do not run tensor-parallel here
    extra = replicated_extra_params(
        mc,
        tp_size,
        qkv_bias=bool(getattr(mc, "qkv_bias", False)),
        tied=bool(getattr(mc, "tie_word_embeddings", False)),
    )
    return extra * dtype_bytes(dtype)


def activation_reserve_bytes(
    mc: ModelShape,
    dtype: str,
    tp_size: int = 1,
    chunked_prefill_size: int = 512,
    max_running_requests: int = 64,
) -> int:
    """Working memory for one forward pass, kept out of the pool. A deliberately rough bound.

    One prefill chunk holds about four hidden-size vectors per token (residual, normed input,
    attention output, projection input) and three intermediate-size ones (gate, up, product, split
    by tp; for an expert layer the top-k experts' and shared experts' sizes summed); one decode
    step holds float32 logits for every running request. This is a few tens of
    MiB even for 70B models: the real headroom for CUDA graphs, allocator slack and collective
    buffers is the (1 - mem_fraction_static) share that the pool never touches.
    """
    inter = math.ceil(mc.token_intermediate_size / tp_size)
    per_token = (4 * mc.hidden_size + 3 * inter) * dtype_bytes(dtype)
    logits = max_running_requests * mc.vocab_size * 4
    return chunked_prefill_size * per_token + logits


def device_memory_bytes(device: str) -> int:
    """Total memory of the device the pool would live on: GPU total, or host MemTotal on cpu."""
    if device.startswith("cuda"):
        import torch  # only when measuring a real GPU: planning must not need torch

        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}: CUDA is not available on this machine")
        return int(torch.cuda.mem_get_info(torch.device(device))[1])
    if device != "cpu":
        raise ValueError(f"--device {device!r}: expected cpu or cuda[:N]")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class PoolPlan:
    """The sizing of one node's KV pool; pool_tokens is always whole pages."""

    model: str
    role: str
    dtype: str
    kv_cache_dtype: str  # resolved: never "auto"
    tp_size: int
    device_memory_bytes: int
    mem_fraction_static: float
    model_bytes: int
    weights_source: str  # "safetensors" (headers) | "config" (num_params)
    num_params: int  # from config.json: every expert (all stay resident)
    num_active_params: int  # read per token: only the top-k routed experts (= num_params dense)
    activation_reserve_bytes: int
    kv_bytes_per_token: int
    memory_pool_tokens: int  # what memory allows, whole pages, even when kv_pool_tokens is set
    pool_source: str  # "kv_pool_tokens" (explicit) | "memory"
    requested_pool_tokens: int | None  # --kv-pool-tokens as given, before rounding to pages
    pool_tokens: int
    pool_pages: int
    page_size: int
    context_length: int
    max_position_embeddings: int
    max_full_context_requests: int
    fits: bool
    lora_bytes: int = 0  # the LoRA slot table (--enable-lora): --max-loras at --max-lora-rank


    @property
    def pool_bytes(self) -> int:
        return self.pool_tokens * self.kv_bytes_per_token

    @property
    def budget_bytes(self) -> int:
        """Bytes left for the pool after weights and the activation reserve (may be negative)."""
        return (
            int(self.device_memory_bytes * self.mem_fraction_static)
            - self.model_bytes
            - self.activation_reserve_bytes
            - self.lora_bytes
        )

    def problem(self) -> str | None:
        """Why one full-context request cannot fit, naming both numbers and the fixing flags."""
        if self.fits:
            return None
        if self.pool_source == "kv_pool_tokens":
            held = (
                f"KV pool holds {self.pool_tokens} tokens (--kv-pool-tokens "
                f"{self.requested_pool_tokens} in whole pages of {self.page_size})"
            )
        elif self.budget_bytes <= 0:
            # Nothing about the KV cache can fix weights that alone exhaust the budget.
            return (
                f"KV pool holds 0 tokens but --context-length is {self.context_length}: weights "
                f"({_gib(self.model_bytes)} per rank) and activation reserve "
                f"({_gib(self.activation_reserve_bytes)}) leave nothing of --mem-fraction-static "
                f"{self.mem_fraction_static} x {_gib(self.device_memory_bytes)}. Use more "
                "--tp-size, a smaller --dtype, raise --mem-fraction-static, or a larger device."
            )
        else:
            held = f"KV pool holds {self.pool_tokens} tokens"
        return (
            f"{held} but --context-length is {self.context_length}: one full-context request "
            "cannot fit. Raise --mem-fraction-static or --kv-pool-tokens, lower --context-length, "
            "use a smaller --kv-cache-dtype or more --tp-size."
        )

    def warnings(self) -> list[str]:
        """Things that do not make the pool too small but will bite at start-up."""
        out = []
        if self.context_length > self.max_position_embeddings:
            out.append(
                f"--context-length {self.context_length} exceeds the model's "
                f"max_position_embeddings {self.max_position_embeddings}"
            )
        if self.pool_source == "kv_pool_tokens" and self.pool_tokens > self.memory_pool_tokens:
            out.append(
                f"--kv-pool-tokens {self.pool_tokens} needs {_gib(self.pool_bytes)}, but only "
                f"{self.memory_pool_tokens} tokens fit in --mem-fraction-static "
                f"{self.mem_fraction_static} of {_gib(self.device_memory_bytes)}: "
                "allocation may fail"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            pool_bytes=self.pool_bytes,
            budget_bytes=self.budget_bytes,
            verdict="OK" if self.fits else "TOO SMALL",
            problem=self.problem(),
            warnings=self.warnings(),
        )
        return d


class CapacityError(Exception):
    """The pool cannot hold one full-context request: the node must not start (incident fault 1)."""

    def __init__(self, plan: PoolPlan) -> None:
        self.plan = plan
        super().__init__(plan.problem())


def plan_pool(
    mc: ModelShape,
    *,
    dtype: str,
    kv_cache_dtype: str = "auto",
    page_size: int = 16,
    context_length: int | None = None,
    kv_pool_tokens: int | None = None,
    mem_fraction_static: float = 0.5,
    device_memory_bytes: int,
    tp_size: int = 1,
    role: str = "unified",
    model_dir: str | Path | None = None,
    chunked_prefill_size: int = 512,
    max_running_requests: int = 64,
    model_name: str | None = None,
    lora_bytes: int = 0,
    head_copy_bytes: int = 0,
) -> PoolPlan:
    """Size one rank's KV pool. An explicit kv_pool_tokens wins over the memory-derived size.

    pool bytes = device memory * mem_fraction_static - weights (per rank) - activation reserve;
    pool tokens = pool bytes // kv_bytes_per_token, rounded down to whole pages. Every role must
    hold one full-context request; the role does not change the formula today.
    """
    if role not in ROLES:
        raise ValueError(f"--role {role!r}: expected one of {', '.join(ROLES)}")
    if page_size < 1:
        raise ValueError(f"--page-size {page_size}: must be >= 1")
    if tp_size < 1:
        raise ValueError(f"--tp-size {tp_size}: must be >= 1")
    if mc.num_heads % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide num_attention_heads {mc.num_heads}")
    if not 0.0 < mem_fraction_static <= 1.0:
        raise ValueError(f"--mem-fraction-static {mem_fraction_static}: must be in (0, 1]")
    if device_memory_bytes < 0:
        raise ValueError(f"device memory {device_memory_bytes} bytes: must be >= 0")
    ctx = mc.max_position_embeddings if context_length is None else context_length
    if ctx < 1:
        raise ValueError(f"--context-length {ctx}: must be >= 1")
    if kv_pool_tokens is not None and kv_pool_tokens < 1:
        raise ValueError(f"--kv-pool-tokens {kv_pool_tokens}: must be >= 1")

    kv_dtype = resolve_kv_dtype(dtype, kv_cache_dtype)
    per_token = kv_bytes_per_token(mc, kv_dtype, tp_size)
    model_bytes, weights_source = _weight_bytes(mc, dtype, tp_size, model_dir)
    model_bytes += head_copy_bytes
    reserve = activation_reserve_bytes(
        mc, dtype, tp_size, chunked_prefill_size, max_running_requests
    )
    budget = int(device_memory_bytes * mem_fraction_static) - model_bytes - reserve - lora_bytes
    memory_pages = max(budget, 0) // per_token // page_size
    # The allocator hands out whole pages, so a partial page at the end is never usable.
    pages = memory_pages if kv_pool_tokens is None else kv_pool_tokens // page_size
    pool_tokens = pages * page_size
    return PoolPlan(
        model=model_name or mc.architecture,
        role=role,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        tp_size=tp_size,
        device_memory_bytes=device_memory_bytes,
        mem_fraction_static=mem_fraction_static,
        model_bytes=model_bytes,
        weights_source=weights_source,
        num_params=mc.num_params,
        num_active_params=mc.num_active_params,
        activation_reserve_bytes=reserve,
        kv_bytes_per_token=per_token,
        memory_pool_tokens=memory_pages * page_size,
        pool_source="memory" if kv_pool_tokens is None else "kv_pool_tokens",
        requested_pool_tokens=kv_pool_tokens,
        pool_tokens=pool_tokens,
        pool_pages=pages,
        page_size=page_size,
        context_length=ctx,
        max_position_embeddings=mc.max_position_embeddings,
        max_full_context_requests=pool_tokens // ctx,
        fits=pool_tokens >= ctx,
        lora_bytes=lora_bytes,
    )


def require_fits(plan: PoolPlan) -> PoolPlan:
    """Return the plan, or raise CapacityError: a pool smaller than one context is never served."""
    if not plan.fits:
        raise CapacityError(plan)
    return plan


def plan_for_engine(
    cfg: EngineConfig,
    mc: ModelShape,
    *,
    role: str = "unified",
    device_memory: int | None = None,
) -> PoolPlan:
    """plan_pool from an EngineConfig, measuring cfg.device unless device_memory is given."""
    return plan_pool(
        mc,
        dtype=cfg.dtype,
        kv_cache_dtype=cfg.kv_cache_dtype,
        page_size=cfg.page_size,
        context_length=cfg.context_length,
        kv_pool_tokens=cfg.kv_pool_tokens,
        mem_fraction_static=cfg.mem_fraction_static,
        device_memory_bytes=(
            device_memory_bytes(cfg.device) if device_memory is None else device_memory
        ),
        tp_size=cfg.tp_size,
        role=role,
        model_dir=cfg.model,
        chunked_prefill_size=cfg.chunked_prefill_size,
        max_running_requests=cfg.max_running_requests,
        model_name=cfg.served_model_name or Path(cfg.model).name,
        lora_bytes=lora_slot_bytes(mc, cfg.enable_lora, cfg.max_loras, cfg.max_lora_rank,
                                   cfg.dtype),
        head_copy_bytes=tied_head_copy_bytes(mc, cfg),
    )


def tied_head_copy_bytes(mc: ModelShape, cfg: EngineConfig) -> int:
    """bf16 on a CPU without bf16 dot products reorders a tied LM head for oneDNN into a copy of
    its own beside the embedding (CausalLM.prepack_onednn): a second vocab x hidden table, split
    by tp. Where the packed kernel runs bf16, the embedding reads its rows from the packed head,
    as float32's does: no copy."""
    from kvfence.model import kernels  # builds the kernel here, as the runner will
    from kvfence.model.linear import onednn_prepacks

    if not getattr(mc, "tie_word_embeddings", False) or not onednn_prepacks(
        cfg.linear_backend,
        cfg.device == "cpu",
        cfg.dtype == "bfloat16",
        kernels.packed_gemm_bf16() is not None,
    ):
        return 0
    return math.ceil(mc.vocab_size * mc.hidden_size * dtype_bytes(cfg.dtype) / cfg.tp_size)


def lora_slot_bytes(
    mc: ModelShape, enable: bool, max_loras: int, max_rank: int, dtype: str
) -> int:
    """The LoRA slot table's device bytes (0 without --enable-lora)."""
    if not enable:
        return 0
    return slot_table_bytes(mc, max_loras, max_rank, dtype_bytes(dtype))  # type: ignore[arg-type]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
