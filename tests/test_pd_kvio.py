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


def test_blocks_received_in_place_hash_to_the_senders_checksums() -> None:
    """Decode hashes a placed run block by block as the blocks land (PageHashes over the
    unmerged views); prefill hashes the run in place (run_pool_checksums): both must be the
    checksums of gather()'s run, the bytes the old path sent and checked."""
    pool = _pool()
    for pages, count in (([1, 2, 3, 4], 4), ([5, 2, 3, 9], 4), ([7], 3), ([11, 10], 4)):
        want = kvio.run_checksums(kvio.gather(pool, pages, count))
        views = kvio.pool_blocks(pool, pages, count, merge=False)
        assert len(views) == 2 * pool.num_layers * len(pages)
        assert b"".join(views) == kvio.gather(pool, pages, count).numpy().tobytes()
        hashes = kvio.PageHashes(len(pages))
        for i, view in enumerate(views):
            hashes.add(i, view)
        assert hashes.digests() == want
        fed = kvio.PageHashes(len(pages))  # as the receiver's hot loop feeds them
        for feed, view in zip(fed.feeds(len(views)), views, strict=True):
            feed(view)
        assert fed.digests() == want
        assert kvio.run_pool_checksums(pool, pages, count) == want
        kvio.corrupt_page(pool, pages[-1])  # a changed page no longer matches
        assert kvio.run_pool_checksums(pool, pages, count)[-1] != want[-1]


def test_batched_read_back_gives_the_in_place_checksums() -> None:
    """batched_checksums (a GPU pool's read-back: one gather on the device, one copy to the
    host) hashes exactly what the in-place host path hashes, a partial last page included, in
    any dtype; and a page scrambled after the fact changes its checksum and only its."""
    for dtype in (torch.float32, torch.bfloat16):
        pool = KVPool(
            num_layers=3, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8,
            dtype=dtype, device="cpu",
        )  # fmt: skip
        pool.k.normal_()
        pool.v.normal_()
        for pages, n_tokens in (([1, 2, 3, 4], 16), ([5, 2, 3, 9], 14), ([7], 3), ([11, 10], 5)):
            want = kvio.pool_checksums(pool, pages, n_tokens)
            assert kvio.batched_checksums(pool, pages, n_tokens) == want
        before = kvio.batched_checksums(pool, [5, 2, 3, 9], 14)
        kvio.corrupt_page(pool, 3)
        after = kvio.batched_checksums(pool, [5, 2, 3, 9], 14)
        assert [a != b for a, b in zip(before, after, strict=True)] == [False, False, True, False]
