"""Fuzzing of every parser a peer or a tenant reaches (issue 47): a short, seeded pass of each
target in tests/fuzz/targets.py (scripts/fuzz.sh runs them coverage-guided for 100,000s of
inputs), and one regression test per bug the fuzzers found, each failing without its fix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "fuzz"))

from mutate import inputs  # noqa: E402
from targets import run_one, targets  # noqa: E402

from kvfence.pd import wire  # noqa: E402
from kvfence.structured.grammar import GrammarError  # noqa: E402
from kvfence.structured.spec import Constraint, ConstraintKind  # noqa: E402

# Enough for every mutation kind and token to reach each parser; the long runs are the script's.
SHORT = {"wire_header": 3000, "session": 1000, "handshake": 1000, "hop": 3000}
COMPILERS = 300


@pytest.mark.parametrize("name", sorted(targets()))
def test_fuzz_short_pass_only_clean_rejections_escape(name: str) -> None:
    target = targets()[name]
    seeds = list(target.seeds())
    for data in inputs(seeds, SHORT.get(name, COMPILERS), seed=47):
        try:
            run_one(target, data)
        except BaseException as e:  # noqa: BLE001 - the property under test
            raise AssertionError(f"{name}: {type(e).__name__}: {e} on input {data[:120]!r}") from e


# ---- the bugs the fuzzers found -------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 100_000,  # nested past the stack: RecursionError
        b'{"t":"Heartbeat","x":' + b"1" * 5000 + b"}",  # past int()'s digit limit: ValueError
        b'{"t":"Hello","info":{"pool_tokens":NaN}}',  # not JSON, though Python's json reads it
        b'{"t":"DoneAck","room":"\\ud800"}',  # a lone surrogate: no text a peer could mean
    ],
)
def test_fuzz_wire_header_refuses_with_wire_error(header: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode_header(header)


def test_fuzz_wire_header_still_takes_every_valid_frame() -> None:
    for data in targets()["wire_header"].seeds():
        assert wire.decode_header(data) is not None


def _grammars():  # type: ignore[no-untyped-def]
    from targets import _grammars

    return _grammars()


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.GRAMMAR, 'root ::= "a'),  # GBNF reader: bare Exception
        Constraint(ConstraintKind.GRAMMAR, 'x ::= "a"'),  # no root rule: bare Exception
        Constraint(ConstraintKind.REGEX, "a\ud800"),  # a RESERVE's json: UnicodeEncodeError
        Constraint(ConstraintKind.JSON_SCHEMA, "[" * 60_000),  # under the size cap: RecursionError
    ],
)
def test_fuzz_grammar_compiler_refuses_with_grammar_error(constraint: Constraint) -> None:
    with pytest.raises(GrammarError):
        _grammars().matcher(constraint, "tenant")


def test_fuzz_valid_gbnf_and_lark_grammars_still_compile() -> None:
    for text in ('root ::= "a" | "b" root', 'start: "a" b\nb: /[0-9]+/'):
        _grammars().matcher(Constraint(ConstraintKind.GRAMMAR, text), "tenant")
