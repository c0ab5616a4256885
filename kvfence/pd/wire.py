"""Wire format of the transfer protocol: length-prefixed frames of a JSON header and a payload.

frame = MAGIC | u32 header_len | u64 payload_len | u64 seq | mac (32) | header (JSON) | payload.
The MAC (pd/auth.py) covers everything but itself. Sizes are bounded so a malformed or hostile
frame is refused before anything is allocated for it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvfence.pd import auth
from kvfence.pd import protocol as p

MAGIC = b"KVF2"
_PREFIX = struct.Struct("!4sIQQ")  # magic, header_len, payload_len, seq; then the MAC
MAX_HEADER = 64 << 20  # a RESERVE carries the prompt's token ids
MAX_PAYLOAD = 1 << 30


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


Frame = p.Message | Hello | HelloOk | HelloRefused | Heartbeat

_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        p.Reserve,
        p.Page,
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


def encode(
    msg: Frame, payload: bytes | memoryview, seq: int, key: bytes
) -> list[bytes | memoryview]:
    """The frame as buffers to write in order (the payload is not copied)."""
    header = json.dumps({"t": type(msg).__name__, **asdict(msg)}, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, len(header), len(payload), seq)
    return [prefix, auth.mac(key, prefix, header, payload), header, payload]


def parse_prefix(prefix: bytes) -> tuple[int, int, int]:
    """(header_len, payload_len, seq) of a frame's fixed part, checked before any allocation."""
    magic, header_len, payload_len, seq = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise WireError("bad magic")
    if header_len > MAX_HEADER or payload_len > MAX_PAYLOAD:
        raise WireError(f"frame too large ({header_len}, {payload_len})")
    return header_len, payload_len, seq


PREFIX_SIZE = _PREFIX.size
MAC_SIZE = auth.MAC_SIZE


def decode_header(raw: bytes) -> Frame:
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not JSON: {e}") from e
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
    if cls is p.Reserve:
        obj["prompt"] = tuple(obj["prompt"])
        obj["dst_pages"] = tuple(obj["dst_pages"])
    return cls(**obj)


_INT_LISTS = {"prompt", "dst_pages"}


def _check_type(msg: str, name: str, annotation: Any, value: Any) -> None:
    ann = str(annotation)
    if name in _INT_LISTS:
        ok = isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
    elif ann == "int":
        ok = type(value) is int
    elif ann == "str":
        ok = isinstance(value, str) and len(value) <= 4096
    elif ann == "dict":
        ok = isinstance(value, dict)
    else:
        ok = False
    if not ok:
        raise WireError(f"{msg}.{name}: bad value")
