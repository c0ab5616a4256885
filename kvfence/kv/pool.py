"""KVPool: paged K/V tensors and the ownership side tables, and the one home of I2 (with I4's
free). Pages are not zeroed on free.

A page is free or owned by exactly one Grant, or (with the prefix cache) sealed: immutable,
owned by the cache (kvfence/kv/prefix.py keeps its keys and references) and readable only by
rows of its namespace (or any row, for a declared public prefix) whose prefix has its key there.
The side tables (owner grant, owner tenant, the grant whose data a page holds, a sealed page's
namespace and key tag) are private tensors, so a batch's ownership check is one vectorised
compare; every check, every "this page now holds grant g's data", every seal and eviction and
every owners log line goes through the methods here. Grant ids are never reused, so a page table
entry taken before a free can never validate after it: the grant id is the page's generation.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfence.kv.prefix import SHARED_ID, PageChain, PrefixCache

FREE = -1
NULL_OWNER = -2
CACHE_OWNER = -3  # a sealed page: the prefix cache's, no grant's; never written again
NULL_PAGE = 0  # a zeroed page never handed out: padding in gathers points here


@dataclass(frozen=True)
class Grant:
    """Ownership of a set of pages by one request of one tenant. grant_id is never reused (a
    64-bit counter), which is what makes a stale page-table entry fail every check."""

    grant_id: int
    tenant_id: int
    request_id: str


class PoolExhausted(Exception):
    """Not enough free pages; the caller must wait or preempt. Nothing was allocated."""


class OwnershipError(Exception):
    """A page was used by a grant that does not own it."""


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        poison_on_free: bool = False,
        prefix: PrefixCache | None = None,
    ) -> None:
        self.prefix = prefix
        self.poison_on_free = poison_on_free  # debug: NaN-fill freed pages so stale reads show
        self.num_layers = num_layers
        self.num_pages = num_pages  # usable pages; the null page comes on top
        self.page_size = page_size
        self.device = torch.device(device)
        total = num_pages + 1
        shape = (num_layers, total * page_size, num_kv_heads, head_dim)
        # torch.empty, not zeros: safety must not depend on what a free page happens to hold.
        self.k = torch.empty(shape, dtype=dtype, device=self.device)
        self.v = torch.empty(shape, dtype=dtype, device=self.device)
        # Masked-out attention still multiplies gathered values by 0, and 0 * NaN is NaN:
        # padding must read finite, owner-less data, so it reads the null page.
        self.k[:, :page_size].zero_()
        self.v[:, :page_size].zero_()
        self._owner_grant = torch.full((total,), FREE, dtype=torch.int64, device=self.device)
        self._owner_tenant = torch.full((total,), FREE, dtype=torch.int64, device=self.device)
        self._owner_grant[NULL_PAGE] = NULL_OWNER
        self._owner_tenant[NULL_PAGE] = NULL_OWNER
        # The grant whose data a page holds (set when its K/V are written, never cleared on free):
        # a page that is owned but holds someone else's stale data fails the read check.
        self._written_by = torch.full((total,), FREE, dtype=torch.int64, device=self.device)
        # A sealed page's namespace id and key tag (kvfence.kv.prefix.key_tag).
        self._sealed_ns = torch.full((total,), FREE, dtype=torch.int64, device=self.device)
        self._sealed_key = torch.zeros((total,), dtype=torch.int64, device=self.device)
        # Free pages as a min-heap: an allocation takes the lowest-numbered ones, so a prompt's
        # pages come out as runs of neighbours rather than scattered over the whole pool (as a
        # FIFO list leaves them once requests churn). Decode attention streams a row's pages:
        # runs of 16 read at 0.75-0.79x the time of scattered ones (benchmarks/RESULTS.md
        # "Kernels"). Which page a grant gets is no part of safety (I2/I3 check ownership).
        self._free: list[int] = list(range(1, total))  # sorted, so already a heap
        self._grant_ids = itertools.count(1)
        self._tenant_ids: dict[str, int] = {}

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (k, v) cache, [slots, kv_heads, head_dim] views of the pool's storage:
        what the model reads and writes, without the grants that decide which slots it may."""
        return [(self.k[i], self.v[i]) for i in range(self.num_layers)]

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free(self) -> int:
        """Pages an allocation can take now: the free list and cached pages no request
        references (evicted on demand)."""
        return len(self._free) + (self.prefix.num_evictable if self.prefix else 0)

    @property
    def num_used(self) -> int:
        """Pages some request holds: owned by its grant, or a cache page it references."""
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        return self.prefix.num_cached if self.prefix else 0

    def num_evictable_among(self, pages: list[int]) -> int:
        """How many of these cached pages no request references (they leave the evictable set
        once someone matches them)."""
        if self.prefix is None:
            return 0
        return sum(1 for p in pages if self.prefix.refcount(p) == 0)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def tenant_id(self, tenant: str) -> int:
        return self._tenant_ids.setdefault(tenant, len(self._tenant_ids))

    def new_grant(self, tenant: str, request_id: str) -> Grant:
        return Grant(next(self._grant_ids), self.tenant_id(tenant), request_id)

    def allocate(self, grant: Grant, n_pages: int) -> list[int]:
        """Take n_pages for grant, all or nothing. Returns the page ids."""
        if n_pages > self.num_free:
            raise PoolExhausted(f"need {n_pages} pages, {self.num_free} free")
        if n_pages > len(self._free):
            assert self.prefix is not None
            self._drop_sealed(self.prefix.evict(n_pages - len(self._free)))
        pages = [heapq.heappop(self._free) for _ in range(n_pages)]
        if pages:
            idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
            assert bool((self._owner_grant[idx] == FREE).all()), "allocating an owned page"
            self._owner_grant[idx] = grant.grant_id
            self._owner_tenant[idx] = grant.tenant_id
        return pages

    def free(self, grant: Grant, pages: list[int]) -> None:
        """Return grant's pages. Callers guarantee no writer can still write them (I4)."""
        if not pages:
            return
        idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
        if not bool((self._owner_grant[idx] == grant.grant_id).all()):
            raise OwnershipError(f"grant {grant.grant_id} frees pages it does not own")
        self._release(idx)
        self._give(pages)

    def free_grant(self, grant: Grant) -> int:
        """Return every page grant owns, found from the side table rather than a page list that
        may be corrupt (the path after an ownership check failed), and drop its cache
        references (kept by grant, not by page list). Returns the page count."""
        self.release_prefix(grant)
        idx = torch.nonzero(self._owner_grant == grant.grant_id).flatten()
        self._release(idx)
        self._give(idx.tolist())
        return int(idx.numel())

    def _give(self, pages: list[int]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)

    def _release(self, idx: torch.Tensor) -> None:
        self._owner_grant[idx] = FREE
        self._owner_tenant[idx] = FREE
        if self.poison_on_free and idx.numel():
            slots = idx[:, None] * self.page_size + torch.arange(self.page_size, device=idx.device)
            self.k[:, slots.flatten()] = float("nan")
            self.v[:, slots.flatten()] = float("nan")

    def check_owned(
        self,
        page_ids: torch.Tensor,
        grant_ids: torch.Tensor,
        tenant_ids: torch.Tensor,
        valid: torch.Tensor,
        must_hold: torch.Tensor | None = None,
        sealed_reads: SealedReads | None = None,
    ) -> torch.Tensor:
        """Rows whose pages are not all owned by the row's grant and tenant, or (where must_hold)
        do not hold data the grant wrote: one compare per batch. With sealed_reads, a page the
        row only reads may instead be a sealed page of the row's namespace (or the shared one)
        whose key is the one the row's prefix has there; a page the row writes never may.

        page_ids [B, P] (padding anywhere `valid` is False), grant_ids [B], tenant_ids [B],
        must_hold [B, P]: pages the row will read. Returns bool [B], True = fail closed.
        """
        g = grant_ids[:, None]
        ok = self._owned(page_ids, g, tenant_ids[:, None])
        if must_hold is not None:
            ok &= (self._written_by[page_ids] == g) | ~must_hold
        if sealed_reads is not None:
            sealed = (
                sealed_reads.read_only
                & (self._owner_grant[page_ids] == CACHE_OWNER)
                & (self._sealed_key[page_ids] == sealed_reads.key_tags)
            )
            if sealed_reads.namespace:
                ns = self._sealed_ns[page_ids]
                sealed &= (ns == sealed_reads.ns_ids[:, None]) | (ns == SHARED_ID)
            ok |= sealed
        return ~(ok | ~valid).all(dim=1)

    def check_source(
        self,
        grant: Grant,
        pages: Sequence[int],
        n_tokens: int,
        sealed: SealedReads | None = None,
    ) -> bool:
        """A transfer's source: every page owned by grant and its tenant, and the pages holding
        its first n_tokens written under it; with sealed (one row), a page may instead be a
        sealed page of the row's namespace (or the shared one) with the row's key there, that
        grant references (so no eviction can take it while it is read). True = sound."""
        idx = self._index(pages)[None, :]
        cols = torch.arange(idx.shape[1], device=self.device)[None, :]
        bad = self.check_owned(
            idx,
            torch.tensor([grant.grant_id], device=self.device),
            torch.tensor([grant.tenant_id], device=self.device),
            torch.ones_like(idx, dtype=torch.bool),
            cols < self.pages_for(n_tokens),
            sealed,
        )
        if sealed is None or self.prefix is None:
            return not bool(bad[0])
        # The verdict and which pages are sealed cross to the host together: on a GPU pool the
        # check of a whole transfer costs one sync, not one per question.
        flags = torch.cat([bad, self._owner_grant[idx[0]] == CACHE_OWNER]).tolist()
        if flags[0]:
            return False
        held = set(self.prefix.held(grant.grant_id))
        return all(p in held for p, c in zip(pages, flags[1:], strict=True) if c)

    def check_destination(self, grant: Grant, pages: Sequence[int]) -> list[bool]:
        """A transfer's destination: per page, True where grant and its tenant still own it (a
        write into any other page must be refused)."""
        if self.device.type == "cpu":
            # Asked per run of a transfer on decode's io loop (twice): numpy views of the same
            # tables answer in a few microseconds, torch's small-index ops in tens.
            idx = np.asarray(pages, dtype=np.int64)
            owner = self._owner_grant.numpy()[idx] == grant.grant_id
            return (owner & (self._owner_tenant.numpy()[idx] == grant.tenant_id)).tolist()
        return self._owned(self._index(pages), grant.grant_id, grant.tenant_id).tolist()

    def mark_written(
        self, grant: Grant | torch.Tensor, pages: Sequence[int] | torch.Tensor
    ) -> None:
        """These pages now hold data written under grant: one Grant for all of them, or a tensor
        of grant ids shaped like pages (a batch's rows, one scatter)."""
        cpu = self.device.type == "cpu"
        if cpu and isinstance(grant, Grant) and not isinstance(pages, torch.Tensor):
            # A transfer run's pages, on decode's io loop: as check_destination.
            self._written_by.numpy()[np.asarray(pages, dtype=np.int64)] = grant.grant_id
            return
        value = grant.grant_id if isinstance(grant, Grant) else grant
        self._written_by[self._index(pages)] = value

    def describe_owners(self, pages: Sequence[int] | torch.Tensor) -> str:
        """The pages' owner grants and the grants whose data they hold, for an I2 failure's log."""
        idx = self._index(pages)
        return (
            f"owners={self._owner_grant[idx].tolist()} "
            f"written_by={self._written_by[idx].tolist()}"
        )

    def _owned(
        self, idx: torch.Tensor, grant_id: torch.Tensor | int, tenant_id: torch.Tensor | int
    ) -> torch.Tensor:
        """Per page: owned by this grant AND its tenant (both compared, neither implies the
        other where a page table or a grant is corrupt)."""
        return (self._owner_grant[idx] == grant_id) & (self._owner_tenant[idx] == tenant_id)

    def _index(self, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(pages, torch.Tensor):
            return pages.to(device=self.device, dtype=torch.int64)
        return torch.tensor(list(pages), dtype=torch.int64, device=self.device)

    # ---- the prefix cache's pages -----------------------------------------------------------

    def match_prefix(self, grant: Grant, chain: PageChain, tokens: list[int], n: int) -> list[int]:
        """The first n cached pages of chain (confirmed against their stored tokens), now
        referenced by grant: shared read-only, never owned by it."""
        assert self.prefix is not None
        return self.prefix.match(grant.grant_id, chain, tokens, n)

    def seal(
        self, grant: Grant, chain: PageChain, start: int, pages: list[int], tokens: list[int]
    ) -> int:
        """pages (chain's pages start, start + 1, ...) pass from grant to the cache, in order,
        until one cannot: a page grant does not own or did not write, or one whose key is cached
        already. Returns how many did; grant keeps a reference to each."""
        assert self.prefix is not None
        if not pages:
            return 0
        idx = self._index(pages)
        ours = (
            self._owned(idx, grant.grant_id, grant.tenant_id)
            & (self._written_by[idx] == grant.grant_id)
        ).tolist()
        n_ours = ours.index(False) if False in ours else len(ours)
        n = self.prefix.seal_run(grant.grant_id, chain, start, pages[:n_ours], tokens)
        if n:
            idx = idx[:n]
            self._owner_grant[idx] = CACHE_OWNER
            self._owner_tenant[idx] = CACHE_OWNER
            ns = [self.prefix.namespace_id(x) for x in chain.namespaces[start : start + n]]
            self._sealed_ns[idx] = self._index(ns)
            self._sealed_key[idx] = self._index(chain.tags[start : start + n])
        return n

    def release_prefix(self, grant: Grant) -> None:
        """Drop every cache reference grant holds (its pages stay cached, evictable if no one
        else holds them)."""
        if self.prefix is not None:
            self.prefix.release(grant.grant_id)

    def expire_prefix(self) -> None:
        """The ttl: cached pages no one used for that long go back to the free list."""
        if self.prefix is not None and self.prefix.ttl is not None:
            self._drop_sealed(self.prefix.expire())

    def _drop_sealed(self, pages: list[int]) -> None:
        """Evicted cache pages (no reference left) back to the free list, poisoned if asked."""
        if not pages:
            return
        idx = self._index(pages)
        assert bool((self._owner_grant[idx] == CACHE_OWNER).all()), "evicting an unsealed page"
        self._release(idx)
        self._sealed_ns[idx] = FREE
        self._sealed_key[idx] = 0
        self._give(pages)

    def evict_unreferenced(self) -> int:
        """Forced eviction (tests, and an operator's flush): every cached page no request
        references goes back to the free list; referenced ones stay. Returns the count."""
        if self.prefix is None:
            return 0
        pages = self.prefix.evict(self.prefix.num_evictable)
        self._drop_sealed(pages)
        return len(pages)

    # ---- tensor parallelism: one page table, N slices ---------------------------------------

    def side_tables(self) -> torch.Tensor:
        """A copy of every side table, [5, pages + 1]: owner grant, owner tenant, written-by,
        sealed namespace, sealed key. Rank 0 of a tensor-parallel engine decides them; the other
        ranks hold slices of the same pages and apply what changed (`apply_side_tables`)."""
        return torch.stack(
            (
                self._owner_grant,
                self._owner_tenant,
                self._written_by,
                self._sealed_ns,
                self._sealed_key,
            )
        )

    def apply_side_tables(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Set the side tables at pages to rows ([5, len(pages)], `side_tables`' order)."""
        idx = self._index(pages)
        rows = rows.to(self.device)
        tables = (
            self._owner_grant,
            self._owner_tenant,
            self._written_by,
            self._sealed_ns,
            self._sealed_key,
        )
        for table, row in zip(tables, rows, strict=True):
            table[idx] = row

    def written_by_for_tests(self) -> torch.Tensor:
        """Test-only: a copy of the written-by table (FREE where a page never held data)."""
        return self._written_by.clone()


@dataclass(frozen=True)
class SealedReads:
    """What a batch's rows may read from sealed pages: read_only [B, P] (pages wholly before
    the chunk), ns_ids [B] (each row's own namespace id), key_tags [B, P] (the keys its
    prefix has at each page, 0 past its full pages); namespace: compare namespaces (off only
    in the prefix_cache_ignore_namespace twin)."""

    read_only: torch.Tensor
    ns_ids: torch.Tensor
    key_tags: torch.Tensor
    namespace: bool = True
