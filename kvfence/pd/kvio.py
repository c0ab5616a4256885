"""Moving one room's K/V between a pool and byte payloads, with per-page checksums.

A page's payload is its valid tokens only (never the stale tail of a partly filled page, which
may hold another tenant's data), laid out as the pool holds them: [2 (K, V), layers, tokens,
kv_heads, head_dim] in the pool's dtype, i.e. 2 * layers contiguous runs of the pool. Its
checksum is xxh3-64 of those bytes. A run of pages with the same token count travels as one
frame: [2, layers, pages, tokens, kv_heads, head_dim], gathered and scattered as whole blocks
(a page's tokens of one layer), one vectorised take / put per K and V.

Tensor parallelism: each rank holds its KV heads' slice of every page, so a run carries the
ranks' slices one after another ([ranks, 2, layers, pages, ...]) and a page's checksum is xxh3-64
of its slices' checksums in rank order (`fold_ranks`): one number per page, whichever rank's
slice changed. Prefill and decode pair only with the same split (pairing.py, I7).
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch
import xxhash

# Frames of up to this many payload bytes. Each frame costs hand-offs between threads and loops
# on both sides; on a few shared cores the transfer is CPU-bound, so the overlap smaller frames
# buy does not pay for them (2 cores, an 8 MiB room: one 8 MiB frame beat four of 2 MiB by
# 13-20% in A/B runs, eight of 1 MiB were slower still). Longer prompts still go as several.
RUN_BYTES = 8 << 20


class PageTensors(Protocol):
    """What moving K/V needs of a pool: its tensors and geometry, not its side tables (the pool
    port's PoolView in the PD services; a KVPool on a rank of its own, or in a test)."""

    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    num_layers: int
    num_pages: int
    device: torch.device


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def fold_ranks(per_rank: Sequence[Sequence[int]]) -> list[int]:
    """Per-page checksums over every rank's slice, from each rank's per-page checksums of its
    own slice; one rank: its own, unchanged."""
    if len(per_rank) == 1:
        return list(per_rank[0])
    return [checksum(struct.pack(f"<{len(col)}Q", *col)) for col in zip(*per_rank, strict=True)]


def page_token_counts(n_tokens: int, page_size: int) -> list[int]:
    full, rest = divmod(n_tokens, page_size)
    return [page_size] * full + ([rest] if rest else [])


def token_bytes(pool: PageTensors) -> int:
    """Bytes of one token of one layer of K (or V)."""
    _, _, kvh, d = pool.k.shape
    return kvh * d * pool.k.element_size()


def payload_size(pool: PageTensors, n_tokens: int) -> int:
    return 2 * pool.num_layers * n_tokens * token_bytes(pool)


def runs(
    pool: PageTensors, n_tokens: int, max_bytes: int = RUN_BYTES
) -> list[tuple[int, int, int]]:
    """(first page, pages, tokens per page) of a room's frames: full pages in runs of at most
    max_bytes (at least one page), then the partial last page alone."""
    full, rest = divmod(n_tokens, pool.page_size)
    per_run = max(1, max_bytes // payload_size(pool, pool.page_size))
    out = [(i, min(per_run, full - i), pool.page_size) for i in range(0, full, per_run)]
    if rest:
        out.append((full, 1, rest))
    return out


def _blocks(t: torch.Tensor, pool: PageTensors, count: int) -> np.ndarray:
    """A CPU pool tensor as a [layers, pages] array whose elements are the first `count` tokens
    of each page, as opaque byte blocks (numpy: single-threaded memcpy per block; torch's
    multi-threaded index ops stall for milliseconds when a core is busy elsewhere)."""
    tb = token_bytes(pool)
    slots = t.shape[1]
    return np.ndarray(
        (pool.num_layers, slots // pool.page_size),
        dtype=np.dtype((np.void, count * tb)),
        buffer=t.view(torch.uint8).numpy(),
        strides=(slots * tb, pool.page_size * tb),
    )


def _as_blocks(run: torch.Tensor) -> np.ndarray:
    two, layers, n, size = run.shape
    return run.numpy().view(np.dtype((np.void, size))).reshape(two, layers, n)


def gather(
    pool: PageTensors,
    pages: list[int],
    count: int,
    buf: bytearray | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first `count` tokens of each page as one contiguous CPU byte tensor in run layout
    [2, layers, len(pages), count * token_bytes], in `out` or in `buf` when it is big enough
    (reusing a buffer spares the page faults of fresh memory, which cost as much as the copy)."""
    size = count * token_bytes(pool)
    if pool.k.is_cuda:
        if out is not None:
            return out.copy_(gather(pool, pages, count))
        idx = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        n = len(pages)
        return torch.stack(
            [
                t.view(pool.num_layers, -1, pool.page_size * token_bytes(pool) // t.element_size())
                .index_select(1, idx)
                .view(torch.uint8)
                .view(pool.num_layers, n, -1)[:, :, :size]
                for t in (pool.k, pool.v)
            ]
        ).cpu()
    shape = (2, pool.num_layers, len(pages), size)
    need = 2 * pool.num_layers * len(pages) * size
    if out is not None:
        assert out.shape == shape and out.is_contiguous()
    elif buf is not None and len(buf) >= need:
        out = torch.frombuffer(buf, dtype=torch.uint8, count=need).view(shape)
    else:
        out = torch.empty(shape, dtype=torch.uint8)
    dst = _as_blocks(out)
    idx = np.asarray(pages, dtype=np.intp)
    for i, t in enumerate((pool.k, pool.v)):
        np.take(_blocks(t, pool, count), idx, axis=1, out=dst[i], mode="clip")
    return out


def run_checksums(run: torch.Tensor) -> list[int]:
    """Per-page checksums of a run-layout byte tensor [2, layers, pages, bytes]: each page's
    2 * layers blocks hashed in order, i.e. the checksum of its page payload ([ranks, 2, layers,
    pages, bytes]: folded over the ranks' slices)."""
    if run.dim() == 5:
        return fold_ranks([run_checksums(r) for r in run])
    two, layers, n, size = run.shape
    flat = memoryview(run.numpy()).cast("B")
    out = []
    for page in range(n):
        h = xxhash.xxh3_64()
        for block in range(two * layers):
            start = (block * n + page) * size
            h.update(flat[start : start + size])
        out.append(h.intdigest())
    return out


def pool_checksums(pool: PageTensors, pages: list[int], n_tokens: int) -> list[int]:
    """Per-page checksums of the first n_tokens held in `pages`, read from the pool itself (a
    CPU pool is hashed in place, without a copy)."""
    counts = page_token_counts(n_tokens, pool.page_size)
    if pool.k.device.type != "cpu":
        return batched_checksums(pool, pages, n_tokens)
    return _hash_pages(pool, pages, counts)


def batched_checksums(pool: PageTensors, pages: list[int], n_tokens: int) -> list[int]:
    """pool_checksums for a pool on a device (any device: CPU tests run this very code): every
    page of the transfer gathered on the device by one index_select per K and V, then one copy
    to the host, the only sync of the whole read-back (none per page or per run), then xxh3 of
    each page's valid bytes in _hash_pages' order (K's layers, then V's): the same numbers."""
    counts = page_token_counts(n_tokens, pool.page_size)
    if not counts:
        return []
    tb = token_bytes(pool)
    idx = torch.tensor(pages[: len(counts)], dtype=torch.int64, device=pool.k.device)
    blocks = torch.stack([
        t.view(torch.uint8).view(pool.num_layers, -1, pool.page_size * tb).index_select(1, idx)
        for t in (pool.k, pool.v)
    ])  # [2, layers, pages, page bytes]
    host = blocks.cpu().numpy()
    out = []
    for i, count in enumerate(counts):
        h = xxhash.xxh3_64()
        for kv in host:
            for layer in kv:
                h.update(layer[i, : count * tb])
        out.append(h.intdigest())
    return out


def run_pool_checksums(pool: PageTensors, pages: list[int], count: int) -> list[int]:
    """Per-page checksums of the first `count` tokens of each of `pages` in a CPU pool, hashed
    in place: what run_checksums gives for the run gather() would copy."""
    return _hash_pages(pool, pages, [count] * len(pages))


# A CPU pool's layers of K then V, each as flat bytes: built once per pool (a tensor-to-bytes view
# costs microseconds, and a transfer asks for them on every run on both sides).
_LAYER_BYTES: weakref.WeakKeyDictionary[PageTensors, list[memoryview]] = weakref.WeakKeyDictionary()


def _layer_bytes(pool: PageTensors) -> list[memoryview]:
    views = _LAYER_BYTES.get(pool)
    if views is None:
        layer = pool.k.shape[1] * token_bytes(pool)
        views = _LAYER_BYTES[pool] = [
            memoryview(t.view(torch.uint8).numpy()).cast("B")[lay * layer : (lay + 1) * layer]
            for t in (pool.k, pool.v)
            for lay in range(pool.num_layers)
        ]
    return views


def _hash_pages(pool: PageTensors, pages: list[int], counts: list[int]) -> list[int]:
    tb = token_bytes(pool)
    # One view per layer of K and V, sliced per page: the loop body is this module's hot spot
    # (2 * layers updates per page, most of the read-back's time beside the hashing itself).
    first, *rest = _layer_bytes(pool)
    pb = pool.page_size * tb
    out = []
    for page, count in zip(pages, counts, strict=False):
        start = page * pb
        end = start + count * tb
        h = xxhash.xxh3_64(first[start:end])
        for block in rest:
            h.update(block[start:end])
        out.append(h.intdigest())
    return out


def corrupt_page(pool: PageTensors, page: int) -> None:
    """Fault injection only: scramble a page's K and V in every layer (a cached page changing
    under a room that references it, e.g. evicted and rewritten)."""
    slots = slice(page * pool.page_size, (page + 1) * pool.page_size)
    pool.k[:, slots] *= -1
    pool.v[:, slots] *= -16


def pool_blocks(
    pool: PageTensors, pages: list[int], count: int, merge: bool = True
) -> list[memoryview]:
    """The bytes gather() would copy, as views of a CPU pool in run layout order ([2, layers,
    pages] blocks of each page's first `count` tokens; with merge, a page's block that directly
    follows the previous page's is merged with it): a run sent straight from the pool, or
    received straight into it, no copy. Unmerged, view i is page i % len(pages)'s."""
    tb = token_bytes(pool)
    pb = pool.page_size * tb
    spans: list[list[int]] = []  # [start, end) within one layer of K or V
    for page in pages:
        start = page * pb
        if merge and spans and spans[-1][1] == start:
            spans[-1][1] = start + count * tb
        else:
            spans.append([start, start + count * tb])
    out = []
    for base in _layer_bytes(pool):
        out += [base[a:b] for a, b in spans]
    return out


class PageHashes:
    """Per-page checksums of a run taken block by block as its unmerged pool_blocks are filled
    (block i belongs to page i % n, and a page's blocks come in the order _hash_pages reads
    them): the digests run_pool_checksums would read back, hashed while each block is still in
    cache."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._hashes = [xxhash.xxh3_64() for _ in range(n)]

    def add(self, i: int, block: memoryview) -> None:
        self._hashes[i % self._n].update(block)

    def feeds(self, n_blocks: int) -> list[Callable[[memoryview], object]]:
        """Per block, what add(i, block) does, as the hash's own update: no Python frame
        per block on the receiver's hot loop."""
        return [self._hashes[i % self._n].update for i in range(n_blocks)]

    def digests(self) -> list[int]:
        return [h.intdigest() for h in self._hashes]


def scatter(
    pool: PageTensors,
    pages: list[int],
    count: int,
    run: torch.Tensor,
    which: list[int] | None = None,
) -> None:
    """Write a received run (byte tensor [2, layers, n, count * token_bytes]) into `pages`, or
    only its entries `which` into those pages: one block copy per K and V."""
    if which is not None:
        run = run[:, :, which]
    if pool.k.is_cuda:
        idx = torch.tensor(pages, dtype=torch.int64, device=pool.device)
        _, layers, n, size = run.shape
        src = run.to(pool.device)
        for i, t in enumerate((pool.k, pool.v)):
            view = t.view(torch.uint8).view(layers, -1, pool.page_size * token_bytes(pool))
            view[:, :, :size].index_copy_(1, idx, src[i])
        return
    src = _as_blocks(run.contiguous())
    idx = np.asarray(pages, dtype=np.intp)
    for i, t in enumerate((pool.k, pool.v)):
        _blocks(t, pool, count)[:, idx] = src[i]
