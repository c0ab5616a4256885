"""PrefixIndex: the router's approximate record, per tenant, of which prompt prefixes it sent to
which worker, i.e. what it predicts each worker's tenant-scoped prefix cache holds.

A prompt is a chain of fixed-size chunks keyed like the workers' cache pages (kvfence/kv/prefix.py:
keyed BLAKE2b over the typed namespace, the parent's key and the chunk), so a chunk's key names
its tenant, its cache_salt and the whole prefix before it. Each tenant has its own table, and a
lookup reads only the asking tenant's. Bounded: an entry cap per tenant and overall (the
overall cap evicts from the tenant holding most, so no tenant can push another below its share),
LRU with the deepest chunks first, and a ttl.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvfence.kv.prefix import Namespace, PageKeyer
from kvfence.server.router.prompt import Prompt, PromptKind

CHUNK_TOKENS = 16  # one worker page at the default --page-size
CHARS_PER_TOKEN = 4  # text without a tokenizer: llm-d's estimate
MAX_CHUNKS = 2048  # a prompt's first ~32k tokens: bounds what hashing a request costs
_KEY_BYTES = 16  # of the 32-byte chunk key, what the tables hold (the chain uses all 32)


@dataclass(frozen=True)
class PrefixKey:
    """A request's chunk chain in its tenant's namespace."""

    tenant: str  # whose table: the credential's tenant (I6), never the body's
    chunks: tuple[bytes, ...]  # the keys of the prompt's full chunks, first chunk first
    symbols: int  # characters or ids the chunks could cover (capped at MAX_CHUNKS)
    chunk_symbols: int

    def share(self, n_chunks: int) -> float:
        """The part of the prompt that `n_chunks` leading chunks cover."""
        return n_chunks * self.chunk_symbols / self.symbols if self.symbols else 0.0

    @property
    def tokens(self) -> int:
        """The prompt's estimated tokens (as far as the index looks)."""
        return self.symbols * CHUNK_TOKENS // self.chunk_symbols


class PrefixIndex:
    def __init__(
        self,
        max_entries: int,
        max_entries_per_tenant: int,
        ttl: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        secret: bytes | None = None,
    ) -> None:
        if not 1 <= max_entries_per_tenant <= max_entries:
            raise ValueError("need 1 <= max_entries_per_tenant <= max_entries")
        self.max_entries = max_entries
        self.max_entries_per_tenant = max_entries_per_tenant
        self.ttl = ttl
        self._clock = clock
        # The router's own secret: keys mean nothing outside this process.
        self._keyer = PageKeyer(secret)
        # tenant -> chunk key -> worker url -> when the router last sent that prefix there;
        # in LRU order (front: least recently sent).
        self._tables: dict[str, OrderedDict[bytes, dict[str, float]]] = {}
        self._size = 0
        self.evictions = 0

    def __len__(self) -> int:
        return self._size

    def tenant_entries(self, tenant: str) -> int:
        return len(self._tables.get(tenant, ()))

    def key(self, namespace: Namespace, prompt: Prompt) -> PrefixKey:
        assert namespace.tenant is not None, "the router's namespaces are tenants'"
        text = prompt.kind is not PromptKind.IDS
        per_chunk = CHUNK_TOKENS * CHARS_PER_TOKEN if text else CHUNK_TOKENS
        symbols = min(len(prompt.symbols), MAX_CHUNKS * per_chunk)
        # The first chunk's parent names the prompt's kind: a text never chains like token ids.
        parent = b"kind:" + prompt.kind.value.encode()
        head = prompt.symbols[:symbols]
        # Characters as their code points, converted in C (a per-character loop cost ~100 ms
        # per request on the event loop at the cap); lone surrogates pass as they came.
        units = (
            array("I", head.encode("utf-32-le", "surrogatepass"))
            if isinstance(head, str)
            else array("q", head)
        )
        chunks = []
        for start in range(0, symbols - per_chunk + 1, per_chunk):
            parent = self._keyer.key(namespace, parent, units[start : start + per_chunk])
            chunks.append(parent[:_KEY_BYTES])
        return PrefixKey(namespace.tenant, tuple(chunks), symbols, per_chunk)

    def match(self, key: PrefixKey, workers: Iterable[str]) -> dict[str, int]:
        """For each of `workers`, how many leading chunks of `key` the router sent it within the
        ttl. Reads the key's tenant's table only."""
        alive = set(workers)
        matched = dict.fromkeys(alive, 0)
        table = self._tables.get(key.tenant)
        if table is None:
            return matched
        fresh_after = self._clock() - self.ttl
        for depth, chunk in enumerate(key.chunks, start=1):
            sent = table.get(chunk)
            if sent is None:
                break
            alive = {w for w in alive if sent.get(w, fresh_after - 1) >= fresh_after}
            if not alive:
                break
            for w in alive:
                matched[w] = depth
        return matched

    def insert(self, key: PrefixKey, worker: str) -> None:
        """Record that the router sent `key`'s prompt to `worker`, then trim to the caps."""
        if not key.chunks:
            return
        now = self._clock()
        table = self._tables.setdefault(key.tenant, OrderedDict())
        # Deepest chunk first, so the LRU front holds leaves and a chain loses its tail before
        # its head (a head without its tail still predicts; the reverse never matches).
        for chunk in reversed(key.chunks):
            sent = table.get(chunk)
            if sent is None:
                table[chunk] = sent = {}
                self._size += 1
            else:
                table.move_to_end(chunk)
            sent[worker] = now
        self._expire(key.tenant, now)
        while len(table) > self.max_entries_per_tenant:
            self._evict_front(key.tenant)
        if self._size > self.max_entries:
            for tenant in list(self._tables):
                self._expire(tenant, now)
            while self._size > self.max_entries:
                # The tenant holding most gives way: one tenant's traffic can push another's
                # entries out only while that other holds more than it does.
                biggest = max(self._tables, key=lambda t: len(self._tables[t]))
                self._evict_front(biggest)

    def forget(self, worker: str) -> int:
        """Drop every prediction about `worker` (it restarted: its cache is empty). Returns the
        chunks no worker is predicted to hold any more, which leave the index."""
        dropped = 0
        for tenant in list(self._tables):
            table = self._tables[tenant]
            for chunk in [c for c, sent in table.items() if worker in sent]:
                sent = table[chunk]
                del sent[worker]
                if not sent:
                    del table[chunk]
                    dropped += 1
            if not table:
                del self._tables[tenant]
        self._size -= dropped
        return dropped

    def _expire(self, tenant: str, now: float) -> None:
        table = self._tables[tenant]
        while table:
            sent = next(iter(table.values()))
            if max(sent.values()) >= now - self.ttl:
                break
            table.popitem(last=False)
            self._size -= 1
        if not table:
            del self._tables[tenant]

    def _evict_front(self, tenant: str) -> None:
        table = self._tables[tenant]
        table.popitem(last=False)
        self._size -= 1
        self.evictions += 1
        if not table:
            del self._tables[tenant]
