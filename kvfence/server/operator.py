"""The operator credential: one key, separate from every tenant key, that opens a node's internal
endpoints (/metrics, /pd/info, /health's detail) and keys the router's signature on the prefill
address it hands a decode (server/hop.py). Tenants never hold it."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from pathlib import Path

from kvfence import env
from kvfence.faults import Faults
from kvfence.server.auth import bearer_token, single_authorization
from kvfence.server.errors import AUTHENTICATION, APIError

MIN_KEY_CHARS = 16


class OperatorKeyError(ValueError):
    """No usable operator key; the message says why and how to give one."""


def load_operator_key(path: str | None) -> str | None:
    """From --admin-api-key-file, else KVFENCE_ADMIN_API_KEY; None when neither is set."""
    if path:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise OperatorKeyError(f"{path}: cannot read the operator key file: {e}") from e
    else:
        key = (env.admin_api_key() or "").strip()
        if not key:
            return None
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise OperatorKeyError(
            f"the operator key must be at least {MIN_KEY_CHARS} characters with no spaces"
        )
    return key


def new_operator_key() -> str:
    return "op-" + secrets.token_hex(32)


def operator_headers(key: str) -> dict[str, str]:
    """What an operator's tool sends to read an internal endpoint."""
    return {"Authorization": f"Bearer {key}"}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class OperatorGate:
    """Who may read a node's internals. A node with tenant keys or an operator key is
    protected: only the operator key opens them (a tenant key does not). A node with neither
    serves one tenant and nobody to hide anything from, so it stays open, as before."""

    def __init__(self, key: str | None, tenant_keys: bool, faults: Faults | None = None) -> None:
        self._digest = _digest(key) if key is not None else None
        self.protected = key is not None or tenant_keys
        self._faults = faults if faults is not None else Faults()

    def is_operator(self, headers: Mapping[str, str] | object) -> bool:
        if not self.protected or not self._faults.guards().on("operator_credential"):
            return True
        if self._digest is None:
            return False
        values = headers.getlist("authorization")  # type: ignore[attr-defined]
        if len(values) != 1:
            return False
        given = bearer_token(values[0])
        return given is not None and hmac.compare_digest(_digest(given), self._digest)

    def require(self, headers: object) -> None:
        """Raise unless the caller holds the operator key (or the node is open)."""
        single_authorization(headers.getlist("authorization"))  # type: ignore[attr-defined]
        if self.is_operator(headers):
            return
        if self._digest is None:
            raise APIError(
                403,
                "This endpoint is for the operator, and this node has no operator key "
                "(--admin-api-key-file).",
                code="operator_only",
                type=AUTHENTICATION,
            )
        raise APIError(
            403,
            "This endpoint is for the operator: send the operator key, not a tenant key.",
            code="operator_only",
            type=AUTHENTICATION,
        )
