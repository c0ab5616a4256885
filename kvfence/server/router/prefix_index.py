"""PrefixIndex: the router's approximate record, per tenant, of which prompt prefixes it sent to
which worker, i.e. what it predicts each worker's tenant-scoped prefix cache holds.

A prompt is a chain of fixed-size chunks keyed like the workers' cache pages (kvfence/kv/prefix.py:
keyed BLAKE2b over the typed namespace, the parent's key and the chunk), so a chunk's key names
its tenant, its cache_salt and the whole prefix before it. Each tenant has its own table, and a
lookup reads only the asking tenant's, and the table of public chunks: those lying entirely
inside an operator-declared public prefix (--shared-prefix-file), keyed in the workers' shared
namespace, which every tenant's workers share anyway (kvfence/kv/prefix.py), so any tenant's
traffic may predict them. Bounded: an entry cap per tenant and overall (the
overall cap evicts from the tenant holding most, so no tenant can push another below its share),
LRU with the deepest chunks first, and a ttl.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvfence.kv.prefix import SHARED, Namespace, PageKeyer, SharedPrefixes
from kvfence.server.router.prompt import Prompt, PromptKind, chat_head

CHUNK_TOKENS = 16  # one worker page at the default --page-size
CHARS_PER_TOKEN = 4  # text without a tokenizer: llm-d's estimate
MAX_CHUNKS = 2048  # a prompt's first ~32k tokens: bounds what hashing a request costs
_KEY_BYTES = 16  # of the 32-byte chunk key, what the tables hold (the chain uses all 32)
PUBLIC = None  # the table of declared public prefixes' chunks (no tenant's)


def _per_chunk(kind: PromptKind) -> int:
    return CHUNK_TOKENS if kind is PromptKind.IDS else CHUNK_TOKENS * CHARS_PER_TOKEN


class PublicPrefixes:
    """The operator's declared public prefixes in the router's units, one trie of full chunks
    per prompt kind: token-id items match id prompts; text items match text prompts by
    characters and chats whose first message starts with them (the router has no tokenizer)."""

    def __init__(self, items: Iterable[str | Sequence[int]] = ()) -> None:
        items = list(items)
        texts = [i for i in items if isinstance(i, str)]
        by_kind = {
            PromptKind.IDS: [list(i) for i in items if not isinstance(i, str)],
            PromptKind.TEXT: texts,
            PromptKind.CHAT: [chat_head(t) for t in texts],
        }
        self.roots = {k: SharedPrefixes(v, _per_chunk(k)).root for k, v in by_kind.items()}


@dataclass(frozen=True)
class PrefixKey:
    """A request's chunk chain in its tenant's namespace."""

    tenant: str  # whose table: the credential's tenant (I6), never the body's
    chunks: tuple[bytes, ...]  # the keys of the prompt's full chunks, first chunk first
    symbols: int  # characters or ids the chunks could cover (capped at MAX_CHUNKS)
    chunk_symbols: int
    public: int = 0  # leading chunks inside a declared public prefix (the PUBLIC table's)

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
        public: PublicPrefixes | None = None,
    ) -> None:
        if not 1 <= max_entries_per_tenant <= max_entries:
            raise ValueError("need 1 <= max_entries_per_tenant <= max_entries")
        self.max_entries = max_entries
        self.max_entries_per_tenant = max_entries_per_tenant
        self.ttl = ttl
        self._clock = clock
        # The router's own secret: keys mean nothing outside this process.
        self._keyer = PageKeyer(secret)
        self._public = public or PublicPrefixes()
        # tenant (or PUBLIC) -> chunk key -> worker url -> when the router last sent that prefix
        # there; in LRU order (front: least recently sent).
        self._tables: dict[str | None, OrderedDict[bytes, dict[str, float]]] = {}
        self._size = 0
        self.evictions = 0

    def __len__(self) -> int:
        return self._size

    def tenant_entries(self, tenant: str | None) -> int:
        return len(self._tables.get(tenant, ()))

    def key(self, namespace: Namespace, prompt: Prompt) -> PrefixKey:
        assert namespace.tenant is not None, "the router's namespaces are tenants'"
        per_chunk = _per_chunk(prompt.kind)
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
        chunks, public = [], 0
        node: dict | None = self._public.roots[prompt.kind]
        for start in range(0, symbols - per_chunk + 1, per_chunk):
            # Public while every chunk so far lies inside one declared prefix (the workers'
            # rule for their shared pages), the tenant's own from the first that does not.
            if node is not None:  # (no declared prefix, or left it: no per-chunk tuple)
                node = node.get(tuple(head[start : start + per_chunk]))
                public += node is not None
            ns = SHARED if node is not None else namespace
            parent = self._keyer.key(ns, parent, units[start : start + per_chunk])
            chunks.append(parent[:_KEY_BYTES])
        return PrefixKey(namespace.tenant, tuple(chunks), symbols, per_chunk, public)

    def match(self, key: PrefixKey, workers: Iterable[str]) -> dict[str, int]:
        """For each of `workers`, how many leading chunks of `key` the router sent it within the
        ttl. Reads the key's tenant's table only (and the public table for its public head)."""
        alive = set(workers)
        matched = dict.fromkeys(alive, 0)
        fresh_after = self._clock() - self.ttl
        for depth, chunk in enumerate(key.chunks, start=1):
            table = self._tables.get(PUBLIC if depth <= key.public else key.tenant)
            sent = table.get(chunk) if table is not None else None
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
        # The public chunks are bounded by what the operator declared; the rest by the caps.
        for owner, chunks in ((key.tenant, key.chunks[key.public :]),
                              (PUBLIC, key.chunks[: key.public])):  # fmt: skip
            if not chunks:
                continue
            table = self._tables.setdefault(owner, OrderedDict())
            # Deepest chunk first, so the LRU front holds leaves and a chain loses its tail
            # before its head (a head without its tail still predicts; the reverse never does).
            for chunk in reversed(chunks):
                sent = table.get(chunk)
                if sent is None:
                    table[chunk] = sent = {}
                    self._size += 1
                else:
                    table.move_to_end(chunk)
                sent[worker] = now
            self._expire(owner, now)
        while len(self._tables.get(key.tenant, ())) > self.max_entries_per_tenant:
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

    def _expire(self, tenant: str | None, now: float) -> None:
        table = self._tables[tenant]
        while table:
            sent = next(iter(table.values()))
            if max(sent.values()) >= now - self.ttl:
                break
            table.popitem(last=False)
            self._size -= 1
        if not table:
            del self._tables[tenant]

    def _evict_front(self, tenant: str | None) -> None:
        table = self._tables[tenant]
        table.popitem(last=False)
        self._size -= 1
        self.evictions += 1
        if not table:
            del self._tables[tenant]
