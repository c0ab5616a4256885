"""PrefixCache: the tenant-scoped prefix cache's bookkeeping (keys, entries, references, LRU).

Pure logic over page ids: it never touches K/V tensors or the pool's side tables. The pool owns
the pages (I2); this module decides which sealed pages a request may reuse, counts who holds
them and which unreferenced ones to evict. Only full pages are cached. A page's key chains
(namespace, parent key, the page's tokens) through a keyed hash under a per-process secret, in a
typed, length-prefixed, domain-separated encoding, and a key match is confirmed against the
entry's stored namespace and tokens before reuse: a hash alone is never trusted.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import secrets
import struct
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kvfence.faults import Faults

KEY_BYTES = 32
SECRET_BYTES = 32  # >= 16 (128 bits) is required; 32 is BLAKE2b's maximum key size
_PERSON = b"kvfence-pfx-v1"  # BLAKE2b personalisation: these keys are prefix-cache page keys
_PERSON_NS = b"kvfence-pfxns-v1"  # ... and these, namespace ids
_PERSON_HELD = b"kvfence-pdpfx-v1"  # ... and these, what a PD decode's cached prefix holds
SHARED_ID = 0  # the shared namespace's id in the pool's side table
_U64 = struct.Struct("<Q")


class NsKind(enum.Enum):
    TENANT = 1  # a tenant's own pages (optionally narrowed by a cache_salt)
    SHARED = 2  # pages lying entirely inside an operator-declared public prefix


@dataclass(frozen=True)
class Namespace:
    """Who may reuse a page. Built by the server from the credential (I6), never from a body;
    `salt` (the request's cache_salt) only narrows a tenant's namespace."""

    kind: NsKind
    tenant: str | None = None  # None only for SHARED
    salt: str | None = None
    # The LoRA adapter the KV was computed with: its content digest, never its name, so a
    # reload of other weights under the same name is another namespace (None: the base model).
    adapter: str | None = None

    def __post_init__(self) -> None:
        if (self.kind is NsKind.SHARED) != (self.tenant is None):
            raise ValueError("a tenant namespace names its tenant; the shared one names none")
        if self.kind is NsKind.SHARED and (self.salt is not None or self.adapter is not None):
            raise ValueError("the shared namespace has no salt and no adapter")

    @staticmethod
    def of_tenant(tenant: str, salt: str | None = None, adapter: str | None = None) -> Namespace:
        return Namespace(NsKind.TENANT, tenant, salt or None, adapter)

    def encode(self) -> bytes:
        """Typed, length-prefixed: no (tenant, salt, adapter) triple encodes like another, and a
        salt can never read as a tenant or an adapter (vLLM #44701). The adapter field comes last
        and only when set, so the base model's encoding is what it always was."""
        out = _field(b"K", bytes([self.kind.value]))
        if self.tenant is not None:
            out += _field(b"T", self.tenant.encode("utf-8"))
        out += _field(b"S", self.salt.encode("utf-8")) if self.salt is not None else b"N"
        if self.adapter is not None:
            out += _field(b"A", self.adapter.encode("utf-8"))
        return out


class _HasDigest(Protocol):
    @property
    def digest(self) -> str: ...


def lora_identity(adapter: _HasDigest | None, faults: Faults) -> str | None:
    """What a request's adapter puts in its namespace: the content digest (None: base model).
    The lora_key_drops_digest twin leaves it out, so two adapters' pages look alike."""
    if adapter is None or not faults.guards().on("lora_digest"):
        return None
    return adapter.digest


SHARED = Namespace(NsKind.SHARED)
# The fault point's namespace: every tenant's pages look alike (what "ignore namespace" means).
_NO_NAMESPACE = Namespace(NsKind.TENANT, "", None)


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + _U64.pack(len(value)) + value


class PageKeyer:
    """key = BLAKE2b-256 keyed by a per-process secret over encode(namespace, parent, tokens)."""

    def __init__(self, secret: bytes | None = None) -> None:
        secret = secrets.token_bytes(SECRET_BYTES) if secret is None else secret
        if not 16 <= len(secret) <= 64:
            raise ValueError("the prefix cache secret must be 16..64 bytes")
        self._secret = secret
        # Bounded: cache_salt is the client's, so the namespaces seen are not.
        self._encode = functools.lru_cache(maxsize=4096)(encode_namespace)
        self.namespace_tag = functools.lru_cache(maxsize=4096)(self._namespace_tag)

    def key(self, ns: Namespace, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        enc = self._encode(ns)
        h = hashlib.blake2b(digest_size=KEY_BYTES, key=self._secret, person=_PERSON)
        for part in encode_page(enc, parent, tokens):
            h.update(part)
        return h.digest()

    def _namespace_tag(self, ns: Namespace) -> int:
        """A namespace's nonzero 64-bit id for the pool's side table (0 is the shared one):
        keyed like the page keys, so no registry grows with the salts clients send."""
        if ns == SHARED:
            return SHARED_ID
        h = hashlib.blake2b(digest_size=8, key=self._secret, person=_PERSON_NS)
        h.update(self._encode(ns))
        return key_tag(h.digest()) or 1


def encode_page(ns_field: bytes, parent: bytes | None, tokens: Sequence[int]) -> tuple[bytes, ...]:
    """The hashed message, in parts: namespace field, parent (or root), token ids as int64.
    Every part is tagged and length-prefixed, so the concatenation parses one way only."""
    return (
        ns_field,
        _field(b"p", parent) if parent is not None else b"r",
        _field(b"t", array("q", tokens).tobytes()),
    )


def encode_namespace(ns: Namespace) -> bytes:
    return _field(b"n", ns.encode())


def held_digest(pages: Iterable[tuple[Namespace, Sequence[int]]], namespaces: bool = True) -> str:
    """What a run of cached pages holds, page by page (namespace, tokens), as a digest both PD
    roles compute alike: decode over its cache entries, prefill over the RESERVE's own tenant,
    salt and prompt. Unkeyed (the two processes share no cache secret); it travels only on the
    authenticated, encrypted transfer connection, beside the prompt itself. namespaces=False:
    the prefix_cache_ignore_namespace twin, for which every tenant's pages look alike."""
    h = hashlib.blake2b(digest_size=16, person=_PERSON_HELD)
    for ns, tokens in pages:
        h.update(encode_namespace(ns if namespaces else _NO_NAMESPACE))
        h.update(_field(b"t", array("q", tokens).tobytes()))
    return h.hexdigest()


def key_tag(key: bytes) -> int:
    """A key's first 64 bits as a signed int64: what the pool's per-page table holds, so the
    per-batch read check compares a row's expected keys with the pages' in one tensor op."""
    return int.from_bytes(key[:8], "little", signed=True)


class SharedPrefixes:
    """Operator-declared public prefixes, as a trie of their full pages: a request's page is
    shared only while every page up to and including it lies inside one declared prefix."""

    def __init__(self, prefixes: Iterable[Sequence[int]], page_size: int) -> None:
        self.root: dict[tuple[int, ...], dict] = {}
        self.num_pages = 0
        for p in prefixes:
            node = self.root
            for i in range(len(p) // page_size):
                page = tuple(p[i * page_size : (i + 1) * page_size])
                if page not in node:
                    node[page] = {}
                    self.num_pages += 1
                node = node[page]


def read_shared_prefix_file(path: str) -> list[str | list[int]]:
    """--shared-prefix-file as written: a JSON list whose items are texts or token-id lists (the
    workers encode the texts; the router, which has no tokenizer, matches them as text)."""
    flag = f"--shared-prefix-file {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{flag}: expected a JSON list of texts or token-id lists")
    for i, item in enumerate(data):
        ids = isinstance(item, list) and all(type(t) is int for t in item)
        if not (isinstance(item, str) or ids):
            raise ValueError(f"{flag}: item {i} is neither a text nor a list of token ids")
    return data


def load_shared_prefixes(
    path: str, encode: Callable[[str], list[int]], vocab_size: int
) -> list[list[int]]:
    """--shared-prefix-file's items as token ids: texts encoded without special tokens, exactly
    as they appear inside a rendered prompt."""
    flag = f"--shared-prefix-file {path}"
    out: list[list[int]] = []
    for i, item in enumerate(read_shared_prefix_file(path)):
        ids = encode(item) if isinstance(item, str) else item
        if not ids or not all(0 <= t < vocab_size for t in ids):
            raise ValueError(f"{flag}: item {i} is empty or has a token id outside the vocabulary")
        out.append(ids)
    return out


@dataclass
class PageChain:
    """A request's full pages as the cache sees them: key and namespace of each, in order.
    Grown as its tokens fill pages; `node` is its place in the shared-prefix trie (None once a
    page left every declared prefix: from there on the tenant's own namespace)."""

    tenant_ns: Namespace
    keys: list[bytes] = field(default_factory=list)
    namespaces: list[Namespace] = field(default_factory=list)
    # key_tag of each key, as the pool's side table holds them; an array, so a batch's rows
    # are copied into one tensor without a Python int per page.
    tags: array = field(default_factory=lambda: array("q"))
    node: dict | None = None

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int  # prompt tokens looked up
    hits: int  # of those, tokens whose KV was reused
    pages: int  # pages the cache holds
    evictable: int  # of those, referenced by no request
    evictions: int
    # At rest both are 0: a request that ended and still holds a reference is a leak.
    holders: int = 0  # grants holding references
    references: int = 0  # references over all pages


@dataclass(eq=False)
class CacheEntry:
    page: int
    key: bytes
    parent: bytes | None
    namespace: Namespace
    tokens: tuple[int, ...]
    last_use: float
    refs: int = 0
    children: int = 0  # cached entries whose parent is this one


class PrefixCache:
    """Sealed pages by key; references by holder (a grant id, never reused), so a holder's
    release is exact even when its page list is suspect; LRU over unreferenced pages only."""

    def __init__(
        self,
        page_size: int,
        *,
        keyer: PageKeyer | None = None,
        shared: SharedPrefixes | None = None,
        ttl: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        faults: Faults | None = None,
    ) -> None:
        self.faults = faults if faults is not None else Faults()
        if ttl is not None and ttl <= 0:
            raise ValueError("prefix cache ttl must be > 0")
        self.page_size = page_size
        self.keyer = keyer or PageKeyer()
        self.shared = shared or SharedPrefixes((), page_size)
        self.ttl = ttl
        self.clock = clock
        self._by_key: dict[bytes, CacheEntry] = {}
        self._by_page: dict[int, CacheEntry] = {}
        self._held: dict[Hashable, list[int]] = {}  # holder -> pages it references
        # Unreferenced entries, least recently released first. A parent is referenced whenever
        # a child is (holders hold whole chains) and released after it, so the front is a leaf.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evictions = 0

    # ---- keys ------------------------------------------------------------------------------

    def chain(self, tokens: Sequence[int], tenant_ns: Namespace) -> PageChain:
        # A declared public prefix is shared as the base model computes it; under an adapter
        # its KV differs, so those pages stay in the tenant's (adapter's) namespace.
        public = self.shared.num_pages and tenant_ns.adapter is None
        c = PageChain(tenant_ns, node=self.shared.root if public else None)
        self.extend(c, tokens)
        return c

    def extend(self, c: PageChain, tokens: Sequence[int]) -> None:
        """Key every full page of tokens that c has not keyed yet."""
        ps = self.page_size
        ignore_ns = not self.faults.guards().on("prefix_namespace")
        for i in range(len(c.keys), len(tokens) // ps):
            page = tuple(tokens[i * ps : (i + 1) * ps])
            ns = c.tenant_ns
            if c.node is not None:
                c.node = c.node.get(page)
                if c.node is not None:
                    ns = SHARED
            parent = c.keys[-1] if c.keys else None
            key = self.keyer.key(_NO_NAMESPACE if ignore_ns else ns, parent, page)
            c.keys.append(key)
            c.namespaces.append(ns)
            c.tags.append(key_tag(key))

    def namespace_id(self, ns: Namespace) -> int:
        """The namespace's 64-bit id in the pool's side table (SHARED_ID for the shared one)."""
        return self.keyer.namespace_tag(ns)

    # ---- reuse -----------------------------------------------------------------------------

    def lookup(self, c: PageChain, tokens: Sequence[int], max_pages: int) -> list[CacheEntry]:
        """The longest run of cached entries that starts c (at most max_pages), each confirmed
        against its stored namespace and tokens. Takes no reference."""
        ps = self.page_size
        guards = self.faults.guards()
        skip_compare = not guards.on("prefix_token_compare")
        ignore_ns = not guards.on("prefix_namespace")
        out: list[CacheEntry] = []
        for i in range(min(max_pages, len(c.keys))):
            e = self._by_key.get(c.keys[i])
            if e is None:
                break
            if not skip_compare and e.tokens != tuple(tokens[i * ps : (i + 1) * ps]):
                break
            if not ignore_ns and e.namespace != c.namespaces[i]:
                break
            out.append(e)
        return out

    def match(
        self, holder: Hashable, c: PageChain, tokens: Sequence[int], max_pages: int
    ) -> list[int]:
        """lookup(), and holder now references the pages found."""
        found = self.lookup(c, tokens, max_pages)
        now = self.clock()
        for e in found:
            self._ref(e, now)
        pages = [e.page for e in found]
        self._held.setdefault(holder, []).extend(pages)
        self.queried(len(tokens), len(pages))
        return pages

    def queried(self, n_tokens: int, hit_pages: int = 0) -> None:
        """Count one admitted prompt's lookup: its tokens, and the pages it reuses (a miss too,
        or the hit rate would be over the prompts that hit only)."""
        self.queried_tokens += n_tokens
        self.hit_tokens += hit_pages * self.page_size

    def seal(
        self, holder: Hashable, c: PageChain, index: int, page: int, tokens: Sequence[int]
    ) -> bool:
        """Page `index` of c, fully written under holder's grant, becomes a cache entry that
        holder references. False (nothing changed) when its key is cached already: the caller
        keeps the page as its own and seals nothing after it, so every entry's parent is held
        by whoever holds the entry."""
        ps = self.page_size
        key = c.keys[index]
        if key in self._by_key or page in self._by_page:
            return False
        parent = c.keys[index - 1] if index else None
        if parent is not None:
            pe = self._by_key.get(parent)
            if pe is None or pe.page not in self._held.get(holder, ()):
                return False  # its parent is not this holder's cached page: no orphan chains
            pe.children += 1
        e = CacheEntry(
            page,
            key,
            parent,
            c.namespaces[index],
            tuple(tokens[index * ps : (index + 1) * ps]),
            self.clock(),
        )
        self._by_key[key] = e
        self._by_page[page] = e
        self._ref(e, e.last_use)
        self._held.setdefault(holder, []).append(page)
        return True

    def seal_run(
        self,
        holder: Hashable,
        c: PageChain,
        start: int,
        pages: Sequence[int],
        tokens: Sequence[int],
    ) -> int:
        """seal() pages[k] as page start + k of c, in order, until one is refused: the count."""
        for k, page in enumerate(pages):
            if not self.seal(holder, c, start + k, page, tokens):
                return k
        return len(pages)

    def release(self, holder: Hashable) -> None:
        """Drop every reference holder has; its last-held pages become evictable, deepest
        first (so a chain is evicted from its leaf)."""
        pages = self._held.pop(holder, [])
        now = self.clock()
        for p in reversed(pages):
            e = self._by_page[p]
            assert e.refs > 0, "releasing an unreferenced cache page"
            e.refs -= 1
            if e.refs == 0:
                e.last_use = now
                self._lru[p] = None

    def _ref(self, e: CacheEntry, now: float) -> None:
        e.refs += 1
        e.last_use = now
        self._lru.pop(e.page, None)

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, n: int) -> list[int]:
        """Up to n least recently used unreferenced pages leave the cache; the caller returns
        them to the pool. A referenced page is never among them."""
        out: list[int] = []
        while len(out) < n and self._lru:
            out.append(self._drop(next(iter(self._lru))))
        return out

    def expire(self) -> list[int]:
        """Unreferenced pages unused for longer than the ttl leave the cache."""
        if self.ttl is None:
            return []
        limit = self.clock() - self.ttl
        out: list[int] = []
        while self._lru:
            e = self._by_page[next(iter(self._lru))]
            if e.last_use > limit:
                break
            out.append(self._drop(e.page))
        return out

    def _drop(self, page: int) -> int:
        e = self._by_page[page]
        assert e.refs == 0 and e.children == 0, "evicting a referenced or inner cache page"
        del self._lru[page]
        del self._by_page[page]
        del self._by_key[e.key]
        if e.parent is not None:
            self._by_key[e.parent].children -= 1
        self.evictions += 1
        return page

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            self.queried_tokens,
            self.hit_tokens,
            len(self._by_page),
            len(self._lru),
            self.evictions,
            len(self._held),
            sum(e.refs for e in self._by_page.values()),
        )

    # ---- views -----------------------------------------------------------------------------

    def is_cached(self, page: int) -> bool:
        return page in self._by_page

    def entry(self, page: int) -> CacheEntry | None:
        return self._by_page.get(page)

    def refcount(self, page: int) -> int:
        return self._by_page[page].refs

    def held(self, holder: Hashable) -> list[int]:
        return list(self._held.get(holder, ()))

    @property
    def num_cached(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_holders(self) -> int:
        return len(self._held)
