"""Tenancy at the door (I6): API key file loading and the key -> tenant lookup, in constant time."""

from __future__ import annotations

import hashlib
import hmac
import re
from pathlib import Path

from kvfence.server.errors import AUTHENTICATION, APIError

DEFAULT_TENANT = "default"
# Tenants become metric labels and page-tag fields; a tight alphabet keeps them unambiguous.
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class ApiKeyFileError(ValueError):
    """The key file cannot be used; the message names the file and line."""


def parse_api_keys(text: str, source: str = "<api keys>") -> dict[str, str]:
    """`key tenant` per line; `#` comments and blank lines allowed; a repeated key is an error."""
    keys: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ApiKeyFileError(
                f"{source}:{lineno}: expected 'KEY TENANT', got {len(fields)} fields"
            )
        key, tenant = fields
        if not _TENANT_RE.match(tenant):
            raise ApiKeyFileError(
                f"{source}:{lineno}: tenant {tenant!r} must match {_TENANT_RE.pattern}"
            )
        if key in keys:
            raise ApiKeyFileError(f"{source}:{lineno}: duplicate API key (first seen earlier)")
        keys[key] = tenant
    if not keys:
        raise ApiKeyFileError(f"{source}: no API keys; omit --api-key-file to run without auth")
    return keys


def load_api_keys(path: str | Path) -> dict[str, str]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ApiKeyFileError(f"{p}: cannot read API key file: {e}") from e
    return parse_api_keys(text, str(p))


def _digest(key: str) -> bytes:
    # Hashing first gives equal-length inputs, so compare_digest leaks neither content nor length.
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class Authenticator:
    """Maps an Authorization header to a tenant. Without keys everyone is DEFAULT_TENANT."""

    def __init__(self, api_keys: dict[str, str] | None) -> None:
        self._keys = [(_digest(k), t) for k, t in (api_keys or {}).items()]
        self.enabled = api_keys is not None

    def tenant_for(self, authorization: str | None) -> str:
        if not self.enabled:
            return DEFAULT_TENANT
        given = bearer_token(authorization)
        if given is None:
            raise _unauthorized("Missing API key: send 'Authorization: Bearer <key>'.")
        digest = _digest(given)
        tenant: str | None = None
        # No early exit: the time taken does not depend on which key (if any) matched.
        for key_digest, key_tenant in self._keys:
            if hmac.compare_digest(digest, key_digest):
                tenant = key_tenant
        if tenant is None:
            raise _unauthorized("Incorrect API key provided.")
        return tenant


def single_authorization(values: list[str]) -> str | None:
    """The request's one Authorization header. Two are refused: a hop that checks the first
    and a hop that forwards the last would disagree on the tenant (I6)."""
    if len(values) > 1:
        raise APIError(
            400,
            "Send exactly one Authorization header.",
            code="duplicate_authorization",
            type=AUTHENTICATION,
        )
    return values[0] if values else None


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def _unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        code="invalid_api_key",
        type=AUTHENTICATION,
        headers={"WWW-Authenticate": "Bearer"},
    )
