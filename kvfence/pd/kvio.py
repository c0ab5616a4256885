"""Moving one room's K/V between a pool and per-page byte payloads, with per-page checksums.

A page's payload is its valid tokens only (never the stale tail of a partly filled page, which
may hold another tenant's data): K then V, each [tokens, layers, kv_heads, head_dim] in the
pool's dtype.
"""

from __future__ import annotations

import torch
import xxhash

from kvfence.kv.pool import KVPool


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


def read_pages(pool: KVPool, pages: list[int], n_tokens: int) -> list[bytes]:
    """Per-page payloads of the first n_tokens held in `pages` (one gather for the room)."""
    slots = _slots(pool, pages, n_tokens)
    k = pool.k[:, slots].transpose(0, 1).contiguous().cpu()  # [n, L, kvh, d]
    v = pool.v[:, slots].transpose(0, 1).contiguous().cpu()
    out, start = [], 0
    for count in page_token_counts(n_tokens, pool.page_size):
        kb = k[start : start + count].view(torch.uint8).numpy().tobytes()
        vb = v[start : start + count].view(torch.uint8).numpy().tobytes()
        out.append(kb + vb)
        start += count
    return out


def payload_size(pool: KVPool, n_tokens: int) -> int:
    _, _, kvh, d = pool.k.shape
    return 2 * n_tokens * pool.num_layers * kvh * d * pool.k.element_size()


def write_page(pool: KVPool, page: int, n_tokens: int, payload: bytes) -> None:
    """Apply one received page: payload must be exactly payload_size(pool, n_tokens) bytes."""
    _, _, kvh, d = pool.k.shape
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(pool.k.dtype)
    kv = flat.view(2, n_tokens, pool.num_layers, kvh, d).to(pool.device)
    slots = _slots(pool, [page], n_tokens)
    pool.k[:, slots] = kv[0].transpose(0, 1)
    pool.v[:, slots] = kv[1].transpose(0, 1)
