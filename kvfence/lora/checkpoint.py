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

from kvfence.lora.sites import EXPERT_TARGETS, TARGETS, Site

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<target>[a-z_]+)\.lora_(?P<ab>[AB])\.weight$"
)
# PEFT's LoRA on a parameter (`target_parameters`) wraps the module once per parameter, nested:
# the routed experts' pairs are named by the nesting, not the parameter; their shapes tell which.
_EXPERT_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+\.experts)(?P<nest>(?:\.base_layer)*)"
    r"\.lora_(?P<ab>[AB])\.weight$"
)
# adapter_config.json fields that change what the adapter computes in ways kvfence does not
# implement: refused, never ignored.
_REFUSED_IF_SET = ("use_dora", "fan_in_fan_out", "modules_to_save", "layer_replication",
                   "lora_bias")


class LoraCheckpointError(ValueError):
    """An adapter directory kvfence cannot serve; the message says which file and why."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter: per site, A_t [in, width] and the block-diagonal B_t [width, out] with
    each slice's scaling folded in (rank padded to the site's width with zeros; one of each per
    expert, stacked, at a routed-experts site), and the adapter's default scaling."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str  # "sha256:<hex>" of what it computes
    sites: dict[str, tuple[torch.Tensor, torch.Tensor]]

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.sites.values())


@dataclass(frozen=True)
class _Scaling:
    """adapter_config.json's rank and alpha, per target by PEFT's rank/alpha patterns."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def of(self, key: str) -> tuple[int, float]:
        """(rank, scaling) of the target at HF path `key`, e.g. "model.layers.0.mlp.down_proj"."""
        r = self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.alpha)
        return r, alpha / math.sqrt(r) if self.rslora else alpha / r


def _pattern_key(patterns: dict, key: str) -> str:
    """PEFT's rule: the first pattern that matches a dotted suffix of the key."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), key)


def load_adapter(
    name: str, path: str, sites: list[Site], max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Read, check and lay out one adapter; raises LoraCheckpointError."""
    root = Path(path)
    sc = _read_config(root)
    if sc.r > max_rank:
        raise LoraCheckpointError(f"{path}: rank {sc.r} exceeds --max-lora-rank {max_rank}")
    try:
        tensors = load_file(str(root / WEIGHTS), device="cpu")
    except (OSError, SafetensorError) as e:
        raise LoraCheckpointError(f"{root / WEIGHTS}: {e}") from e
    linear, experts = _pairs(tensors, root)
    laid: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    scalings: dict[str, float] = {}
    by_module = {(s.module, n): (s, j) for s in sites if not s.experts
                 for j, (n, _) in enumerate(s.slices)}
    for (module, target), (a, b) in sorted(linear.items()):
        found = by_module.get((module, target))
        if found is None:
            raise LoraCheckpointError(
                f"{root / WEIGHTS}: {module}.{target} is no projection kvfence applies LoRA to "
                "(attention q/k/v/o everywhere; gate/up/down of dense MLPs and shared experts; "
                "the routed experts' gate_up_proj and down_proj)"
            )
        site, j = found
        r, scaling = _checked_rank(sc, f"{module}.{target}", a, b, site, max_rank, root)
        width = dict(site.slices)[target]
        if a.shape != (r, site.in_dim) or b.shape != (width, r):
            raise LoraCheckpointError(
                f"{root / WEIGHTS}: {module}.{target}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}, expected ({r}, {site.in_dim}) and ({width}, {r})"
            )
        a_t, b_t = laid.get(site.key) or _empty(site, max_rank, dtype)
        col, row = sum(n for _, n in site.slices[:j]), j * max_rank
        a_t[:, row : row + r] = a.t().to(dtype)
        b_t[row : row + r, col : col + width] = b.t().to(dtype) * scaling
        laid[site.key] = (a_t, b_t)
        scalings[f"{module}.{target}"] = scaling
    for (module, nest), (a, b) in sorted(experts.items()):
        site = _expert_site(sites, module, a, b, root)
        if site.key in laid:
            raise LoraCheckpointError(f"{root / WEIGHTS}: {module}: two pairs for {site.key}")
        target = f"{module}.{site.slices[0][0]}"
        n = site.experts
        r, scaling = _checked_rank(sc, target, a, b, site, max_rank, root, n)
        a_t, b_t = _empty(site, max_rank, dtype)
        # PEFT's layout: expert e's A is rows [e*r, (e+1)*r) of A, its B the columns
        # e, e + n, e + 2n, ... of B (B viewed [out, r, experts]).
        a_t[:, :, :r] = a.view(n, r, site.in_dim).transpose(1, 2).to(dtype)
        b_t[:, :r, :] = b.view(site.out_dim, r, n).permute(2, 1, 0).to(dtype) * scaling
        laid[site.key] = (a_t, b_t)
        scalings[target + nest] = scaling
    if not laid:
        raise LoraCheckpointError(f"{root / WEIGHTS}: no lora_A/lora_B weights")
    default = sc.alpha / math.sqrt(sc.r) if sc.rslora else sc.alpha / sc.r
    return LoraAdapter(name, str(root), sc.r, default, _digest(scalings, tensors), laid)


def _checked_rank(
    sc: _Scaling, key: str, a: torch.Tensor, b: torch.Tensor, site: Site, max_rank: int,
    root: Path, experts: int = 1,
) -> tuple[int, float]:
    r, scaling = sc.of(key)
    if r > max_rank * site.rank_scale:
        raise LoraCheckpointError(
            f"{root / CONFIG}: {key} has rank {r}, over --max-lora-rank {max_rank}"
            + (" (x2: PEFT fuses the experts' gate and up)" if site.rank_scale > 1 else "")
        )
    if a.shape[0] != r * experts or b.shape[1] != r * experts:
        raise LoraCheckpointError(
            f"{root / WEIGHTS}: {key}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
            f"do not hold rank {r}" + (f" for {experts} experts" if experts > 1 else "")
        )
    return r, scaling


def _expert_site(sites: list[Site], module: str, a: torch.Tensor, b: torch.Tensor,
                 root: Path) -> Site:
    """The routed-experts site whose input and output widths the pair's shapes have."""
    fits = [s for s in sites if s.experts and s.module == module
            and (a.shape[1], b.shape[0]) == (s.in_dim, s.out_dim)]
    if len(fits) != 1:
        raise LoraCheckpointError(
            f"{root / WEIGHTS}: {module}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} fit "
            f"{'no' if not fits else 'more than one'} routed-experts parameter kvfence serves"
        )
    return fits[0]


def _read_config(root: Path) -> _Scaling:
    try:
        cfg = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoraCheckpointError(f"{root / CONFIG}: {e}") from e
    if not isinstance(cfg, dict):
        raise LoraCheckpointError(f"{root / CONFIG}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraCheckpointError(f"{root / CONFIG}: peft_type {cfg['peft_type']!r} is not LORA")
    for field in _REFUSED_IF_SET:
        if cfg.get(field):
            raise LoraCheckpointError(f"{root / CONFIG}: {field} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraCheckpointError(f"{root / CONFIG}: bias {cfg['bias']!r} is not supported")
    targets, params = cfg.get("target_modules"), cfg.get("target_parameters") or []
    # A string is PEFT's regex over module paths: the weights present say what it matched.
    if not isinstance(targets, str) and not (
        isinstance(targets, list) and (targets or params) and set(targets) <= set(TARGETS)
    ):
        raise LoraCheckpointError(
            f"{root / CONFIG}: target_modules must name some of {', '.join(TARGETS)}"
        )
    if not isinstance(params, list) or any(
        not isinstance(p, str) or p.rpartition(".")[2] not in EXPERT_TARGETS for p in params
    ):
        raise LoraCheckpointError(
            f"{root / CONFIG}: target_parameters may name only the routed experts' "
            f"{' and '.join(EXPERT_TARGETS)}"
        )
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoraCheckpointError(f"{root / CONFIG}: r must be a positive int, lora_alpha a number")
    rp, ap = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    if not (isinstance(rp, dict) and all(isinstance(v, int) and v > 0 for v in rp.values())
            and isinstance(ap, dict) and all(isinstance(v, (int, float)) for v in ap.values())):
        raise LoraCheckpointError(
            f"{root / CONFIG}: rank_pattern and alpha_pattern map patterns to numbers"
        )
    return _Scaling(r, float(alpha), bool(cfg.get("use_rslora", False)), rp, ap)


def _pairs(tensors: dict[str, torch.Tensor], root: Path) -> tuple[dict, dict]:
    """(module, target) -> [A, B] of the projections; (module, nesting) -> [A, B] of the
    routed experts' parameters."""
    linear: dict[tuple[str, str], list] = {}
    experts: dict[tuple[str, str], list] = {}
    for key, t in tensors.items():
        if t.dim() != 2 or not t.is_floating_point():
            raise LoraCheckpointError(f"{root / WEIGHTS}: unexpected tensor {key}")
        if (m := _EXPERT_KEY.match(key)) is not None:
            experts.setdefault((m["module"], m["nest"]), [None, None])["AB".index(m["ab"])] = t
        elif (m := _KEY.match(key)) is not None and m["target"] in TARGETS:
            linear.setdefault((m["module"], m["target"]), [None, None])["AB".index(m["ab"])] = t
        else:
            raise LoraCheckpointError(f"{root / WEIGHTS}: unexpected tensor {key}")
    for (module, target), (a, b) in [*linear.items(), *experts.items()]:
        if a is None or b is None:
            raise LoraCheckpointError(f"{root / WEIGHTS}: {module}{target} lacks lora_A or lora_B")
    return linear, experts


def _empty(site: Site, max_rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w, lead = site.width(max_rank), (site.experts,) if site.experts else ()
    return (torch.zeros(*lead, site.in_dim, w, dtype=dtype),
            torch.zeros(*lead, w, site.out_dim, dtype=dtype))


def _digest(scalings: dict[str, float], tensors: dict[str, torch.Tensor]) -> str:
    """Typed and length-prefixed, so no two adapters encode alike: each target's scaling, then
    each tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256(b"kvfence-lora-v2")

    def put(tag: bytes, part: bytes) -> None:
        h.update(tag + struct.pack("<Q", len(part)) + part)

    for key in sorted(scalings):
        put(b"k", key.encode())
        put(b"s", struct.pack("<d", scalings[key]))
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        put(b"n", key.encode())
        put(b"d", str(t.dtype).encode())
        put(b"z", struct.pack(f"<{t.dim()}q", *t.shape))
        put(b"b", t.view(torch.uint8).numpy().tobytes())
    return "sha256:" + h.hexdigest()
