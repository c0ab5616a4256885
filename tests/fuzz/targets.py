"""Fuzz targets: every parser a peer or a tenant reaches, each as one_input(bytes) that may fail
only with its module's clean rejection type. tests/fuzz/run.py drives them coverage-guided
(atheris, with libFuzzer's per-input time and memory caps); tests/test_fuzz.py runs a short,
seeded pass of each in the suite.

A target returns normally or raises one of its `rejects`; anything else is a bug. Seeds are
valid inputs, so mutations start deep in the parser instead of at its first check.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "kvfence-tiny"


@dataclass(frozen=True)
class Target:
    name: str
    one_input: Callable[[bytes], None]
    rejects: tuple[type[BaseException], ...]
    seeds: Callable[[], Iterable[bytes]]
    wire_format: bool  # a byte format a peer sends: fuzzed for >= 100,000 inputs


def run_one(target: Target, data: bytes) -> None:
    """The property: no exception but the target's clean rejection escapes."""
    try:
        target.one_input(data)
    except target.rejects:
        pass


# ---- the PD wire: one frame header ----------------------------------------------------------


def _frames() -> list[Any]:
    from kvfence.pd import protocol as p
    from kvfence.pd import wire

    return [
        wire.Hello(_local_info()),
        wire.HelloOk(_local_info()),
        wire.HelloRefused("page_size differs"),
        wire.Heartbeat(),
        wire.PageRun("r1", 0, 16, (1, 2, 3)),
        p.Reserve("r1", "t", (1, 2, 3), {"temperature": 0.0}, 8, (4, 5), 7, "salt", 0, ""),
        p.Done("r1", 3, 1, 99, 5, {"5": -0.1}, 0),
        p.DoneAck("r1"),
        p.Abort("r1", "kv_transfer_incomplete", "pages missing", 503),
        p.AbortAck("r1"),
    ]


def _local_info() -> dict[str, Any]:
    return {
        "role": "prefill",
        "transfer_backend": "tcp",
        "model_fingerprint": "ab" * 16,
        "context_length": 256,
        "pool_tokens": 4096,
        "page_size": 16,
        "kv_dtype": "float32",
        "kv_layout": [2, 1, 256, "page-blocks"],
        "tp_layout": [1, 1],
    }


def _wire_header(data: bytes) -> None:
    from kvfence.pd import wire

    wire.decode_header(data)


def _wire_header_seeds() -> list[bytes]:
    from kvfence.pd import wire

    out = []
    for frame in _frames():
        raw = bytes(wire.encode(frame)[0])
        out.append(raw[wire.PREFIX_SIZE :])
    return out


# ---- the PD session: a TLS connection's plaintext, frame after frame ---------------------------


class _Plaintext:
    """An SSLObject stand-in whose decrypted stream is the fuzz input (TLS itself is the
    handshake target's): Connection.recv's own framing, hello cap and payload reads run on it."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0

    def read(self, n: int, buf: Any = None) -> Any:
        if self._pos >= len(self._data):
            raise ssl.SSLZeroReturnError("end of the fuzz input")
        chunk = self._data[self._pos : self._pos + n]
        self._pos += len(chunk)
        if buf is None:
            return bytes(chunk)
        buf[: len(chunk)] = chunk
        return len(chunk)


@cache
def _loop_and_socket() -> tuple[asyncio.AbstractEventLoop, socket.socket]:
    loop = asyncio.new_event_loop()
    a, _b = socket.socketpair()
    _keep.append(_b)
    return loop, a


_keep: list[socket.socket] = []


def _session(data: bytes) -> None:
    from kvfence.pd import wire
    from kvfence.pd.pairing import pairing_problem
    from kvfence.pd.transport.tcp import Connection

    loop, sock = _loop_and_socket()
    local = _local_info()

    async def read_all() -> None:
        conn = Connection(sock, _Plaintext(data), ssl.MemoryBIO(), ssl.MemoryBIO(), False)  # type: ignore[arg-type]
        try:
            while True:
                frame, _payload = await conn.recv()
                if isinstance(frame, wire.Hello | wire.HelloOk):
                    problem = pairing_problem(local, frame.info)
                    assert problem is None or isinstance(problem, str)
        except ConnectionError:
            return  # the end of the stream

    loop.run_until_complete(read_all())


def _session_seeds() -> list[bytes]:
    from kvfence.pd import wire

    frames = _frames()
    stream = b"".join(
        b"".join(bytes(v) for v in wire.encode(f, b"\x00" * 32 if i == 4 else b""))
        for i, f in enumerate(frames)
    )
    hello_ok = bytes(wire.encode(wire.Hello(_local_info()))[0])
    return [stream, hello_ok, hello_ok + stream[len(hello_ok) :][:200]]


# ---- the TLS handshake: a stranger's first bytes at a prefill's port --------------------------


@cache
def _tls_server() -> Any:
    from tls_certs import tls

    return tls("prefill")


def _handshake(data: bytes) -> None:
    from kvfence.faults import Faults
    from kvfence.pd.transport.tcp import _secure

    loop, _ = _loop_and_socket()
    server, client = socket.socketpair()
    try:
        client.sendall(data[: 200_000])
        client.shutdown(socket.SHUT_WR)  # then EOF: the handshake cannot wait for more
        loop.run_until_complete(_secure(server, _tls_server(), Faults(), client=False))
    finally:
        server.close()
        client.close()


def _handshake_seeds() -> list[bytes]:
    # A real ClientHello of a decode (and the start of its second flight), captured in memory.
    from tls_certs import tls

    ctx = tls("decode").context(server=False, verify=True)
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_side=False)
    try:
        obj.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = out.read()
    return [hello, hello[:5], hello + b"\x14\x03\x03\x00\x01\x01", b"\x16\x03\x01\x00\x00"]


# ---- the router's signed hop header at a decode ---------------------------------------------


class _Headers:
    def __init__(self, values: dict[str, list[str]]) -> None:
        self._values = values

    def getlist(self, name: str) -> list[str]:
        return self._values.get(name, [])


def _hop(data: bytes) -> None:
    from kvfence.server import hop

    # Headers reach the app as latin-1 text (ASGI), split here on NUL into address, signatures.
    parts = data.decode("latin-1").split("\x00")
    values = {hop.HEADER_PREFILL: parts[:1], hop.HEADER_SIGNATURE: parts[1:]}
    verifier = hop.HopVerifier("operator-key", clock=lambda: 1_000_000.0)
    got = verifier.prefill(_Headers(values))
    assert got is None or isinstance(got, str)


def _hop_seeds() -> list[bytes]:
    from kvfence.server import hop

    signed = hop.sign_prefill("operator-key", "10.0.0.1:7000", now=1_000_000.0)
    good = f"{signed[hop.HEADER_PREFILL]}\x00{signed[hop.HEADER_SIGNATURE]}".encode("latin-1")
    return [good, b"10.0.0.1:7000\x00123.ab.cd", b"10.0.0.1:7000", b"a\x00\xb2.x.y"]


def _hop_rejects() -> tuple[type[BaseException], ...]:
    from kvfence.server.errors import APIError

    return (APIError,)


# ---- tenant input to the grammar and tool-schema compilers ----------------------------------


@cache
def _grammars() -> Any:
    from kvfence.structured.grammar import Grammars

    cfg = json.loads((TINY / "config.json").read_text())
    return Grammars((TINY / "tokenizer.json").read_text(), cfg["vocab_size"], [2])


def _json_input(data: bytes) -> Any:
    # Python's json, as a RESERVE's sampling dict is read: lone surrogates and all.
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


class _Rejected(Exception):
    """The API's 4xx or the compiler's GrammarError, as the target's one rejection type."""


def _compile(constraint: Any) -> None:
    from kvfence.structured.grammar import GrammarError

    if constraint is None:
        return
    try:
        m = _grammars().matcher(constraint, "tenant")
    except GrammarError as e:
        raise _Rejected(e.code) from e
    m.accept(5)
    m.done  # noqa: B018 - reads the matcher's state, as the step loop does


def _api_call(fn: Callable[[], Any]) -> Any:
    from kvfence.server.errors import APIError

    try:
        return fn()
    except APIError as e:
        assert 400 <= e.status < 500, (e.status, e.code)
        raise _Rejected(e.code) from e


def _structured(data: bytes) -> None:
    from kvfence.server.structured import constraint_of

    body = _json_input(data)
    if not isinstance(body, dict):
        return
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf is not None and not isinstance(rf, dict) or so is not None and not isinstance(so, dict):
        return  # the request model's types (schemas.py) refuse these before this code runs
    _compile(_api_call(lambda: constraint_of(rf, so, body.get("extra") or {})))


def _structured_seeds() -> list[bytes]:
    bodies = [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {
                "type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}}},
            "required": ["a"]}}}},
        {"structured_outputs": {"regex": "[0-9]{1,3}(\\.[a-z]+)?"}},
        {"structured_outputs": {"choice": ["yes", "no", "a|b"]}},
        {"structured_outputs": {"grammar": 'start: "a" b\nb: /[0-9]+/'}},
        {"structured_outputs": {"grammar": 'root ::= "x" [a-c]*'}},
        {"structured_outputs": {"json": {"type": "string", "enum": ["p", "q"]}}},
        {"structured_outputs": {"json_object": True}},
        {"extra": {"guided_json": {}}},
    ]
    return [json.dumps(b).encode() for b in bodies]


def _tools(data: bytes) -> None:
    from kvfence.server.tools import plan_tools

    body = _json_input(data)
    if not isinstance(body, dict):
        return
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        return  # the request model's types refuse it first
    parser = body.get("parser")
    parallel = body.get("parallel_tool_calls")
    parallel = parallel if isinstance(parallel, bool) else None
    plan = _api_call(
        lambda: plan_tools(
            tools,
            body.get("tool_choice"),
            parallel,
            parser if parser in ("hermes", "llama3_json", None) else None,
        )
    )
    _compile(plan.constraint if plan is not None else None)


def _tools_seeds() -> list[bytes]:
    fn = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    }
    bodies = [
        {"tools": [fn], "tool_choice": "required"},
        {"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tools": [fn], "tool_choice": "auto", "parser": "hermes"},
        {"tools": [fn, {"type": "function", "function": {"name": "f2"}}], "tool_choice": "required",
         "parallel_tool_calls": False},
        {"tools": [], "tool_choice": "none"},
    ]
    return [json.dumps(b).encode() for b in bodies]


def _grammar(data: bytes) -> None:
    from kvfence.structured.spec import Constraint, ConstraintKind

    if not data:
        return
    kinds = list(ConstraintKind)
    kind = kinds[data[0] % len(kinds)]
    # surrogatepass: a RESERVE's constraint comes through Python's json, lone surrogates and all
    value = data[1:].decode("utf-8", "surrogatepass") if _decodes(data[1:]) else ""
    _compile(Constraint(kind, value))


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return False
    return True


def _grammar_seeds() -> list[bytes]:
    from kvfence.structured.spec import ConstraintKind

    kinds = list(ConstraintKind)
    values = {
        ConstraintKind.JSON_SCHEMA: '{"type":"object","properties":{"a":{"type":"number"}}}',
        ConstraintKind.JSON_OBJECT: "",
        ConstraintKind.REGEX: "(ab|c)+[0-9]{2,4}",
        ConstraintKind.CHOICE: '["x", "y.z", "\\u00e9"]',
        ConstraintKind.GRAMMAR: 'root ::= "a" | "b" root',
    }
    return [bytes([kinds.index(k)]) + v.encode() for k, v in values.items()] + [
        bytes([kinds.index(ConstraintKind.GRAMMAR)]) + b'start: x\nx: "q"+'
    ]


def _wire_rejects() -> tuple[type[BaseException], ...]:
    from kvfence.pd.wire import WireError

    return (WireError,)


def targets() -> dict[str, Target]:
    wire_rejects = _wire_rejects()
    return {
        t.name: t
        for t in (
            Target("wire_header", _wire_header, wire_rejects, _wire_header_seeds, True),
            Target(
                "session", _session, (*wire_rejects, ConnectionError), _session_seeds, True
            ),
            Target("handshake", _handshake, (ConnectionError,), _handshake_seeds, True),
            Target("hop", _hop, _hop_rejects(), _hop_seeds, True),
            Target("structured", _structured, (_Rejected,), _structured_seeds, False),
            Target("tools", _tools, (_Rejected,), _tools_seeds, False),
            Target("grammar", _grammar, (_Rejected,), _grammar_seeds, False),
        )
    }
