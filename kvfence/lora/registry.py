"""The adapters a node serves, by name, each with the tenants allowed to use it. Resolution is the
one place a name becomes an adapter: a name a tenant may not use resolves exactly like a name
that does not exist, so the HTTP layer's 404 cannot tell the two apart."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from kvfence.lora.checkpoint import LoraAdapter, load_adapter
from kvfence.lora.config import LoraModuleSpec, LoraRegistryError
from kvfence.lora.sites import Site


@dataclass(frozen=True)
class Served:
    spec: LoraModuleSpec
    adapter: LoraAdapter


class LoraRegistry:
    """Thread-safe: the HTTP threads resolve and the operator loads while the engine runs. An
    unloaded adapter's weights stay with the requests that resolved it (they finish with them)."""

    def __init__(
        self, sites: list[Site], max_rank: int, dtype: torch.dtype, reserved: frozenset[str]
    ) -> None:
        self.sites, self.max_rank, self.dtype = sites, max_rank, dtype
        self.reserved = reserved  # the base model's names: no adapter may shadow them
        self._lock = threading.Lock()
        self._by_name: dict[str, Served] = {}

    def load(self, spec: LoraModuleSpec) -> LoraAdapter:
        if spec.name in self.reserved:
            raise LoraRegistryError(f"`{spec.name}` is the base model's name")
        with self._lock:
            if spec.name in self._by_name:
                raise LoraRegistryError(f"an adapter named `{spec.name}` is already loaded")
        adapter = load_adapter(spec.name, spec.path, self.sites, self.max_rank, self.dtype)
        with self._lock:
            if spec.name in self._by_name:  # a concurrent load of the same name won
                raise LoraRegistryError(f"an adapter named `{spec.name}` is already loaded")
            self._by_name[spec.name] = Served(spec, adapter)
        return adapter

    def unload(self, name: str) -> None:
        with self._lock:
            if self._by_name.pop(name, None) is None:
                raise LoraRegistryError(
                    f"no adapter named `{name}` is loaded", 404, "model_not_found"
                )

    def resolve(self, name: str, tenant: str) -> LoraAdapter | None:
        """The adapter `name` if `tenant` may use it; None otherwise, whichever the reason."""
        with self._lock:
            served = self._by_name.get(name)
        return served.adapter if served is not None and served.spec.allows(tenant) else None

    def names_for(self, tenant: str) -> list[str]:
        with self._lock:
            return sorted(n for n, s in self._by_name.items() if s.spec.allows(tenant))

    def by_digest(self, digest: str, tenant: str) -> LoraAdapter | None:
        """A served adapter with this content digest that `tenant` may use (a PD prefill's
        lookup of the adapter a RESERVE names)."""
        with self._lock:
            for s in self._by_name.values():
                if s.adapter.digest == digest and s.spec.allows(tenant):
                    return s.adapter
        return None
