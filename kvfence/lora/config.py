"""--lora-modules as vLLM spells it: `name=path`, or JSON {"name", "path", "tenants"} where the
optional "tenants" lists who may use the adapter (absent: every tenant). Torch-free: the config
validates the flags with it before anything loads."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class LoraSpecError(ValueError):
    """A --lora-modules entry that cannot be read; the message names it."""


class LoraRegistryError(ValueError):
    """A load or unload the registry refuses (the HTTP layer maps it to a 4xx)."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_lora") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class LoraModuleSpec:
    name: str
    path: str
    tenants: frozenset[str] | None = None  # None: every tenant

    def allows(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


def parse_lora_module(text: str) -> LoraModuleSpec:
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise LoraSpecError(f"--lora-modules {text!r}: {e}") from e
        return spec_from_fields(data, f"--lora-modules {text!r}")
    name, sep, path = text.partition("=")
    if not sep:
        raise LoraSpecError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return spec_from_fields({"name": name, "path": path}, f"--lora-modules {text!r}")


def spec_from_fields(data: object, where: str) -> LoraModuleSpec:
    """From a JSON object (the flag's JSON form; the load endpoint's body as vLLM names it,
    lora_name / lora_path, is mapped by the caller)."""
    if not isinstance(data, dict) or set(data) - {"name", "path", "tenants", "base_model_name"}:
        raise LoraSpecError(f"{where}: expected an object with name, path and optional tenants")
    name, path, tenants = data.get("name"), data.get("path"), data.get("tenants")
    if not isinstance(name, str) or not NAME.match(name):
        raise LoraSpecError(f"{where}: name must be 1-128 letters, digits or ._:/-")
    if not isinstance(path, str) or not path:
        raise LoraSpecError(f"{where}: path must be a directory")
    if tenants is not None and not (
        isinstance(tenants, list) and all(isinstance(t, str) and t for t in tenants)
    ):
        raise LoraSpecError(f"{where}: tenants must be a list of tenant ids")
    return LoraModuleSpec(name, path, frozenset(tenants) if tenants is not None else None)
