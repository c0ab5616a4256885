"""kvio's zero-copy run views: the bytes sent straight from the pool are exactly gather()'s."""

from __future__ import annotations

import torch

from kvfence.kv.pool import KVPool
from kvfence.pd import kvio


def _pool() -> KVPool:
    pool = KVPool(
        num_layers=3, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8,
        dtype=torch.float32, device="cpu",
    )  # fmt: skip
    pool.k.normal_()
    pool.v.normal_()
    return pool


def test_pool_blocks_are_the_gathered_run() -> None:
    pool = _pool()
    for pages, count in (([1, 2, 3, 4], 4), ([5, 2, 3, 9], 4), ([7], 3), ([11, 10], 4)):
        blocks = kvio.pool_blocks(pool, pages, count)
        assert b"".join(blocks) == kvio.gather(pool, pages, count).numpy().tobytes()
        sums = kvio.pool_checksums(pool, pages, len(pages) * count)
        assert sums == kvio.run_checksums(kvio.gather(pool, pages, count))
