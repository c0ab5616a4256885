"""I8: the cluster secret and the keys derived from it that authenticate every transfer frame.

A connection starts under a hello key (derived from the secret alone); HELLO and HELLO_OK carry
fresh 128-bit nonces from both sides, and everything after them is MACed under a per-connection
session key derived from the secret and both nonces, with a strictly increasing sequence number.
A frame from another connection, a replayed or reordered one, or one forged without the secret
fails its MAC or sequence check; the receiver drops the connection and changes nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

ENV = "KVFENCE_CLUSTER_SECRET"
MAC_SIZE = 32
MIN_SECRET_BYTES = 16


class SecretError(ValueError):
    """No usable cluster secret; the message says how to provide one."""


def load_cluster_secret(path: str | None) -> bytes:
    """From --cluster-secret-file, else KVFENCE_CLUSTER_SECRET. Required for PD roles."""
    if path:
        raw = Path(path).read_bytes().strip()
    elif os.environ.get(ENV):
        raw = os.environ[ENV].strip().encode()
    else:
        raise SecretError(
            "PD workers authenticate their transfer traffic: pass --cluster-secret-file FILE "
            f"or set {ENV} (the same secret on every prefill and decode; `kvfence up` makes one)"
        )
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def new_secret() -> str:
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(16)


def hello_key(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=32, person=b"kvfence-hello").digest()


def session_key(secret: bytes, client_nonce: str, server_nonce: str) -> bytes:
    data = f"{client_nonce}:{server_nonce}".encode()
    return hashlib.blake2b(
        data, key=hello_key(secret), digest_size=32, person=b"kvfence-session"
    ).digest()


def mac(key: bytes, *parts: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=MAC_SIZE)
    for part in parts:
        h.update(part)
    return h.digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
