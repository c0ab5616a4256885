"""I7 pairing: the facts a prefill and a decode exchange at bootstrap, and the comparison that
refuses a pair whose KV would not mean the same thing on both sides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from kvfence.guards import ALL_ON, Guards
from kvfence.model.loader import checkpoint_files

if TYPE_CHECKING:
    from kvfence.pd.pool_port import PoolView

_SAMPLE = 1 << 20  # bytes hashed from each end of a large weight file


def model_fingerprint(model_dir: str | Path) -> str:
    """config.json + every weight file's size and bytes (whole when small, both ends when large).
    Two nodes serving different weights or configs get different fingerprints."""
    model_dir = Path(model_dir)
    h = xxhash.xxh3_128()
    cfg = json.loads((model_dir / "config.json").read_text())
    h.update(json.dumps(cfg, sort_keys=True).encode())
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            if size <= 4 * _SAMPLE:
                h.update(f.read())
            else:
                h.update(f.read(_SAMPLE))
                f.seek(size - _SAMPLE)
                h.update(f.read(_SAMPLE))
    return h.hexdigest()


def node_info(
    engine: Any, view: PoolView, role: str, fingerprint: str, backend: str = "tcp"
) -> dict[str, Any]:
    """view: the pool's geometry, as the pool port gives it."""
    mc = engine.model_config
    return {
        "role": role,
        "transfer_backend": backend,
        "model_fingerprint": fingerprint,
        "context_length": engine.context_length,
        "pool_tokens": view.capacity_tokens,
        "page_size": view.page_size,
        "kv_dtype": str(view.k.dtype).removeprefix("torch."),
        "kv_layout": [mc.num_layers, mc.num_kv_heads, mc.head_dim, "page-blocks"],  # kvio.py layout
        # Ranks and KV heads per rank: a run carries every rank's slice (pd/tp_slices.py), so
        # two nodes pair only with the same split; unequal sizes are refused, not re-sliced.
        "tp_layout": [engine.cfg.tp_size, view.k.shape[2]],
    }


def pairing_problem(
    local: dict[str, Any], remote: dict[str, Any], guards: Guards = ALL_ON
) -> str | None:
    """Why these two nodes must not pair, or None."""
    if not guards.on("pairing_check"):
        return None
    for key in (
        "transfer_backend",
        "model_fingerprint",
        "page_size",
        "kv_dtype",
        "kv_layout",
        "tp_layout",
        "context_length",
    ):
        if local.get(key) != remote.get(key):
            return (
                f"{key} differs: {local.get('role')} has {local.get(key)!r}, "
                f"{remote.get('role')} has {remote.get(key)!r}"
            )
    for side in (local, remote):
        if side.get("unsafe_skip_capacity"):
            continue  # a test running the incident's undersized pool on purpose
        if (
            not isinstance(side.get("pool_tokens"), int)
            or side["pool_tokens"] < side["context_length"]
        ):
            return (
                f"{side.get('role')} pool holds {side.get('pool_tokens')} tokens, less than "
                f"the context length {side.get('context_length')}"
            )
    return None
