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


def test_read_back_of_a_scattered_run_is_its_checksums() -> None:
    """decode reads a run back from the pool right after scattering it: those checksums are
    the sender's, and a byte changed in the pool afterwards changes that page's only."""
    src, dst = _pool(), _pool()
    for pages, count in (([1, 2, 3, 4], 4), ([7], 3)):
        run = kvio.gather(src, pages, count)
        targets = [11 - p for p in pages]
        kvio.scatter(dst, targets, count, run)
        assert kvio.page_checksums(dst, targets, count) == kvio.run_checksums(run)
    before = kvio.page_checksums(dst, [10, 9, 8, 7], 4)
    dst.v[2, 9 * 4 + 1, 1, 5] += 1.0  # layer 2, page 9, token 1
    after = kvio.page_checksums(dst, [10, 9, 8, 7], 4)
    assert [a != b for a, b in zip(before, after, strict=True)] == [False, True, False, False]
