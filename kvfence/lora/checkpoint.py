"""A PEFT LoRA checkpoint (adapter_config.json + adapter_model.safetensors) loaded on the CPU,
checked against the model's sites, and laid out per site as the slot table holds it. Its
identity is a digest of what it computes (scaling, tensor names, shapes, dtypes and bytes), never
its name: the prefix cache and the PD hand-off key KV by it."""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvfence.lora.sites import TARGETS, Site

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<target>[a-z_]+)\.lora_(?P<ab>[AB])\.weight$"
)
# adapter_config.json fields that change what the adapter computes in ways kvfence does not
# implement: refused, never ignored.
_REFUSED_IF_SET = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern",
                   "alpha_pattern", "layer_replication", "target_parameters", "lora_bias")


class LoraCheckpointError(ValueError):
    """An adapter directory kvfence cannot serve; the message says which file and why."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter: per site, A_t [in, rank * slices] and the block-diagonal B_t
    [rank * slices, out] (rank padded to max_lora_rank with zeros), and the scaling."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # "sha256:<hex>" of what it computes
    sites: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.sites.values())


def load_adapter(
    name: str, path: str, sites: list[Site], max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read, check and lay out one adapter; raises LoraCheckpointError."""
    root = Path(path)
    cfg = _read_config(root)
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoraCheckpointError(f"{root / CONFIG}: r must be a positive int, lora_alpha a number")
    if r > max_rank:
        raise LoraCheckpointError(f"{path}: rank {r} exceeds --max-lora-rank {max_rank}")
    for field in _REFUSED_IF_SET:
        if cfg.get(field):
            raise LoraCheckpointError(f"{root / CONFIG}: {field} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraCheckpointError(f"{root / CONFIG}: bias {cfg['bias']!r} is not supported")
    rslora = bool(cfg.get("use_rslora", False))
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    try:
        tensors = load_file(str(root / WEIGHTS), device="cpu")
    except (OSError, SafetensorError) as e:
        raise LoraCheckpointError(f"{root / WEIGHTS}: {e}") from e
    pairs = _pairs(tensors, root)
    by_module = {(s.module, n): (s, j) for s in sites for j, (n, _) in enumerate(s.slices)}
    laid: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for (module, target), (a, b) in sorted(pairs.items()):
        found = by_module.get((module, target))
        if found is None:
            raise LoraCheckpointError(
                f"{root / WEIGHTS}: {module}.{target} is no projection kvfence applies LoRA to "
                "(attention q/k/v/o everywhere; gate/up/down of dense MLPs and shared experts)"
            )
        site, j = found
        width = dict(site.slices)[target]
        if a.shape != (r, site.in_dim) or b.shape != (width, r):
            raise LoraCheckpointError(
                f"{root / WEIGHTS}: {module}.{target}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, expected ({r}, {site.in_dim}) and ({width}, {r})"
            )
        a_t, b_t = laid.get(site.key) or _empty(site, max_rank, dtype)
        col = sum(n for _, n in site.slices[:j])
        a_t[:, j * max_rank : j * max_rank + r] = a.t().to(dtype)
        b_t[j * max_rank : j * max_rank + r, col : col + width] = b.t().to(dtype)
        laid[site.key] = (a_t, b_t)
    if not laid:
        raise LoraCheckpointError(f"{root / WEIGHTS}: no lora_A/lora_B weights")
    return LoraAdapter(name, str(root), r, scaling, _digest(scaling, tensors), laid)


def _read_config(root: Path) -> dict:
    try:
        cfg = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoraCheckpointError(f"{root / CONFIG}: {e}") from e
    if not isinstance(cfg, dict):
        raise LoraCheckpointError(f"{root / CONFIG}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraCheckpointError(f"{root / CONFIG}: peft_type {cfg['peft_type']!r} is not LORA")
    targets = cfg.get("target_modules")
    # A string is PEFT's regex over module paths: the weights present say what it matched.
    if not isinstance(targets, str) and not (
        isinstance(targets, list) and targets and set(targets) <= set(TARGETS)
    ):
        raise LoraCheckpointError(
            f"{root / CONFIG}: target_modules must name some of {', '.join(TARGETS)}"
        )
    return cfg


def _pairs(tensors: dict[str, torch.Tensor], root: Path) -> dict:
    out: dict[tuple[str, str], list] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m["target"] not in TARGETS or t.dim() != 2 or not t.is_floating_point():
            raise LoraCheckpointError(f"{root / WEIGHTS}: unexpected tensor {key}")
        out.setdefault((m["module"], m["target"]), [None, None])["AB".index(m["ab"])] = t
    for (module, target), (a, b) in out.items():
        if a is None or b is None:
            raise LoraCheckpointError(f"{root / WEIGHTS}: {module}.{target} lacks lora_A or lora_B")
    return out


def _empty(site: Site, max_rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    r = max_rank * len(site.slices)
    return torch.zeros(site.in_dim, r, dtype=dtype), torch.zeros(r, site.out_dim, dtype=dtype)


def _digest(scaling: float, tensors: dict[str, torch.Tensor]) -> str:
    """Typed and length-prefixed, so no two adapters encode alike: the scaling, then each tensor's
    name, dtype, shape and bytes in name order."""
    h = hashlib.sha256(b"kvfence-lora-v1")
    h.update(b"s" + struct.pack("<d", scaling))
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        for tag, part in ((b"n", key.encode()), (b"d", str(t.dtype).encode()),
                          (b"z", struct.pack(f"<{t.dim()}q", *t.shape)),
                          (b"b", t.view(torch.uint8).numpy().tobytes())):
            h.update(tag + struct.pack("<Q", len(part)) + part)
    return "sha256:" + h.hexdigest()
