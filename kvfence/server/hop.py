"""The router's word to a decode: which prefill to dial. The router signs the address under a key
derived from the operator key, with an expiry and a one-time nonce; a decode dials only an
address whose signature checks out and whose nonce it has not seen, so a tenant who reaches a
decode port cannot make it dial anything, and a signed header cannot be used twice."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

from kvfence.faults import Faults
from kvfence.server.errors import APIError

HEADER_PREFILL = "X-Kvfence-Prefill"
HEADER_SIGNATURE = "X-Kvfence-Prefill-Signature"
# How long a signature is good for. It is checked when the request reaches the decode, a hop
# within the cluster, so a minute is generous (clocks of the hosts are assumed NTP-synced).
VALID_S = 60
_MAX_ADDRESS = 300
_EXPIRY = re.compile(r"[0-9]{1,20}")


def _hop_key(operator_key: str) -> bytes:
    # Its own key, so a signature never doubles as the bearer token or the other way round.
    return hashlib.blake2b(operator_key.encode(), digest_size=32, person=b"kvfence-hop").digest()


def _mac(key: bytes, address: str, expires: int, nonce: str) -> str:
    msg = f"kvfence-prefill-v1\n{address}\n{expires}\n{nonce}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign_prefill(operator_key: str, address: str, now: float | None = None) -> dict[str, str]:
    """The headers that tell a decode to take this request's KV from `address`."""
    expires = int(now if now is not None else time.time()) + VALID_S
    nonce = secrets.token_hex(16)
    mac = _mac(_hop_key(operator_key), address, expires, nonce)
    return {HEADER_PREFILL: address, HEADER_SIGNATURE: f"{expires}.{nonce}.{mac}"}


def _refused(message: str) -> APIError:
    return APIError(403, message, code="unsigned_prefill", type="invalid_request_error")


class HopVerifier:
    """A decode's check of the router's signed prefill address (see the module docstring)."""

    def __init__(
        self,
        operator_key: str | None,
        faults: Faults | None = None,
        clock: Callable[[], float] = time.time,
        dials: bool = True,
    ) -> None:
        """dials: this node dials the address (a decode); any other role never reads it, so
        there the header is dropped unchecked, as it always was ignored."""
        self._dials = dials
        self._key = _hop_key(operator_key) if operator_key is not None else None
        self._faults = faults if faults is not None else Faults()
        self._clock = clock
        # Nonces used, with their expiry, oldest first: a nonce leaves once its signature has
        # expired anyway, so the set holds at most VALID_S seconds of requests.
        self._seen: set[str] = set()
        self._order: deque[tuple[int, str]] = deque()
        self._lock = threading.Lock()

    def prefill(self, headers: object) -> str | None:
        """The prefill address this request may use, None when it names none; raises a 403
        (before anything is reserved or dialled) when it names one the router did not sign."""
        addresses = headers.getlist(HEADER_PREFILL)  # type: ignore[attr-defined]
        if not addresses or not self._dials:
            return None
        if len(addresses) != 1 or len(addresses[0]) > _MAX_ADDRESS:
            raise _refused("Send exactly one prefill address.")
        address = addresses[0]
        if not self._faults.guards().on("hop_signature"):
            return address  # the twin: the old behaviour, dial on the client's word
        if self._key is None:
            raise _refused(
                "This decode takes prefill addresses only from its router, and has no operator "
                "key to check the router's signature (--admin-api-key-file)."
            )
        signatures = headers.getlist(HEADER_SIGNATURE)  # type: ignore[attr-defined]
        parts = signatures[0].split(".") if len(signatures) == 1 else []
        # ASCII digits, at most 20: str.isdigit() also takes "²", which int() refuses.
        if len(parts) != 3 or not _EXPIRY.fullmatch(parts[0]):
            raise _refused("The prefill address carries no router signature.")
        expires, nonce, mac = int(parts[0]), parts[1], parts[2]
        want = _mac(self._key, address, expires, nonce)
        if not hmac.compare_digest(want.encode(), mac.encode()):
            raise _refused("The prefill address's signature does not check out.")
        now = int(self._clock())
        if not now <= expires <= now + VALID_S + 5:
            raise _refused("The prefill address's signature has expired.")
        with self._lock:
            while self._order and self._order[0][0] < now:
                self._seen.discard(self._order.popleft()[1])
            if nonce in self._seen:
                raise _refused("The prefill address's signature was already used.")
            self._seen.add(nonce)
            self._order.append((expires, nonce))
        return address
