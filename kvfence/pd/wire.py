"""Wire format of the transfer protocol: length-prefixed frames of a JSON header and a payload.

frame = MAGIC | u32 header_len | u64 payload_len | header (JSON) | payload, inside the
connection's TLS session (pd/tls.py: integrity, order, replay and confidentiality are TLS's).
Sizes are bounded so a malformed or hostile frame is refused before anything is allocated for
it, and strictly decoded so a peer's bug cannot become an exception anywhere else. K/V travel
as PageRun frames: a run of a room's pages in one frame (decode feeds its pages to the protocol
as one RunArrived).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, fields
from typing import Any

from kvfence.pd import protocol as p

MAGIC = b"KVF4"  # KVF4: frames inside TLS, no MAC or sequence number of their own
_PREFIX = struct.Struct("!4sIQ")  # magic, header_len, payload_len
MAX_HEADER = 64 << 20  # a RESERVE carries the prompt's token ids
MAX_PAYLOAD = 256 << 20  # a PageRun is a few MiB (kvio.RUN_BYTES), or one page if larger
MAX_HELLO_HEADER = 64 << 10  # the pairing facts: a hello claiming more is refused unread


class WireError(ValueError):
    """A frame or message that does not decode; the connection that sent it is dropped."""


@dataclass(frozen=True)
class Hello:
    """decode -> prefill on connect: the facts both sides must agree on to pair (I7)."""

    info: dict


@dataclass(frozen=True)
class HelloOk:
    info: dict


@dataclass(frozen=True)
class HelloRefused:
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class PageRun:
    """prefill -> decode: pages first .. first + len(checksums) - 1 of a room (positions in
    dst_pages), each holding n_tokens valid tokens, with one checksum per page. The payload is
    kvio's run layout (empty when the pages went by one-sided writes). The receiver checks each
    page on its own and feeds the run as one protocol RunArrived (the fold of its pages'
    PageArrived events)."""

    room: str
    first: int
    n_tokens: int
    checksums: tuple[int, ...]


Frame = p.Message | Hello | HelloOk | HelloRefused | Heartbeat | PageRun

_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        p.Reserve,
        PageRun,
        p.Done,
        p.DoneAck,
        p.Abort,
        p.AbortAck,
        Hello,
        HelloOk,
        HelloRefused,
        Heartbeat,
    )
}


Payload = bytes | memoryview | list[memoryview]


def encode(msg: Frame, payload: Payload = b"") -> list[memoryview]:
    """The frame as buffers to write in order: prefix and header joined, then the payload
    (not copied; a list is one payload in pieces, in order)."""
    # Fields are flat (ints, strings, int tuples, plain dicts): a shallow dict gives the same JSON
    # as asdict(), which deep-copies a RESERVE's prompt token by token on the loop.
    body = {f.name: getattr(msg, f.name) for f in fields(msg)}
    header = json.dumps({"t": type(msg).__name__, **body}, separators=(",", ":")).encode()
    parts = [memoryview(b).cast("B") for b in (payload if isinstance(payload, list) else [payload])]
    prefix = _PREFIX.pack(MAGIC, len(header), sum(b.nbytes for b in parts))
    return [memoryview(prefix + header), *parts]


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    """(header_len, payload_len) of a frame's fixed part, checked before any allocation."""
    magic, header_len, payload_len = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError("bad magic")
    if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise WireError(f"frame too large ({header_len}, {payload_len})")
    return header_len, payload_len


PREFIX_SIZE = _PREFIX.size


def decode_header(raw: bytes) -> Frame:
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        # ValueError: not JSON, not UTF-8, NaN/Infinity, or an int past Python's digit limit;
        # RecursionError: arrays nested past the stack (a header may be 64 MiB).
        raise WireError(f"header is not JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise WireError("header lacks a type")
    cls = _TYPES.get(obj.pop("t"))
    if cls is None:
        raise WireError("unknown message type")
    names = {f.name: f for f in fields(cls)}
    if set(obj) != set(names):
        raise WireError(f"{cls.__name__}: fields {sorted(obj)} != {sorted(names)}")
    for name, value in obj.items():
        _check_type(cls.__name__, name, names[name].type, value)
    for name in _INT_LISTS & set(obj):
        obj[name] = tuple(obj[name])
    if cls is PageRun and not obj["checksums"]:
        raise WireError("PageRun carries no pages")
    return cls(**obj)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate: no string a peer could mean
        return False
    return True


_INT_LISTS = {"prompt", "dst_pages", "checksums"}
_U64 = 1 << 64


def _check_type(msg: str, name: str, annotation: Any, value: Any) -> None:
    ann = str(annotation)
    if name in _INT_LISTS:
        ok = isinstance(value, list) and all(type(v) is int and 0 <= v < _U64 for v in value)
    elif ann == "int":
        ok = type(value) is int
    elif ann == "str":
        ok = isinstance(value, str) and len(value) <= 4096 and _utf8(value)
    elif ann == "dict":
        ok = isinstance(value, dict)
    else:
        ok = False
    if not ok:
        raise WireError(f"{msg}.{name}: bad value")
