"""Moving one room's K/V between a pool and per-page byte payloads, with per-page checksums.

A page's payload is its valid tokens only (never the stale tail of a partly filled page, which
may hold another tenant's data): [tokens, 2 (K, V), layers, kv_heads, head_dim] in the pool's
dtype.
"""

from __future__ import annotations

import warnings

import torch
import xxhash

from kvfence.kv.pool import KVPool

# Received payloads are read-only bytes that we only read from; torch warns on every wrap.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def page_token_counts(n_tokens: int, page_size: int) -> list[int]:
    full, rest = divmod(n_tokens, page_size)
    return [page_size] * full + ([rest] if rest else [])


def _slots(pool: KVPool, pages: list[int], n_tokens: int) -> torch.Tensor:
    ps = pool.page_size
    page_t = torch.tensor(pages, dtype=torch.int64)
    slots = (page_t[:, None] * ps + torch.arange(ps)).reshape(-1)[:n_tokens]
    return slots.to(pool.device)


def _room_tensor(pool: KVPool, pages: list[int], n_tokens: int) -> torch.Tensor:
    """The room's valid tokens as one contiguous [n, 2, layers, kv_heads, head_dim] tensor (K and
    V side by side per token), so every page's payload is one contiguous slice."""
    slots = _slots(pool, pages, n_tokens)
    k = pool.k.index_select(1, slots)  # [L, n, kvh, d]
    v = pool.v.index_select(1, slots)
    return torch.stack((k, v), dim=0).permute(2, 0, 1, 3, 4).contiguous().cpu()


def read_pages(pool: KVPool, pages: list[int], n_tokens: int) -> list[bytes]:
    """Per-page payloads of the first n_tokens held in `pages` (one gather for the room, then
    one copy per page out of it)."""
    room = _room_tensor(pool, pages, n_tokens)
    flat = memoryview(room.view(torch.uint8).numpy()).cast("B")
    per_token = flat.nbytes // max(n_tokens, 1)
    out, start = [], 0
    for count in page_token_counts(n_tokens, pool.page_size):
        out.append(bytes(flat[start * per_token : (start + count) * per_token]))
        start += count
    return out


def payload_size(pool: KVPool, n_tokens: int) -> int:
    _, _, kvh, d = pool.k.shape
    return 2 * n_tokens * pool.num_layers * kvh * d * pool.k.element_size()


def write_page(pool: KVPool, page: int, n_tokens: int, payload: bytes | memoryview) -> None:
    """Apply one received page: payload must be exactly payload_size(pool, n_tokens) bytes. A
    page's slots are contiguous in every layer, so this is two slice copies."""
    _, _, kvh, d = pool.k.shape
    raw = torch.frombuffer(memoryview(payload), dtype=torch.uint8)
    kv = raw.view(pool.k.dtype).view(n_tokens, 2, pool.num_layers, kvh, d).to(pool.device)
    start = page * pool.page_size
    pool.k[:, start : start + n_tokens].copy_(kv[:, 0].transpose(0, 1))
    pool.v[:, start : start + n_tokens].copy_(kv[:, 1].transpose(0, 1))
