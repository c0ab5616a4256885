"""A small seeded mutator: the suite's short fuzz pass, deterministic and without libFuzzer
(tests/fuzz/run.py is the coverage-guided run)."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

# Byte strings that reach the corners parsers get wrong: nesting past the stack, numbers past
# Python's digit limit, JSON's non-finite constants, lone surrogates, non-ASCII digits.
TOKENS = (
    b"[" * 3000,
    b"{\"a\":" * 1500,
    b"9" * 5000,
    b"NaN",
    b"-Infinity",
    b"\\ud800",
    b"\xb2",
    b"\x00",
    b"\xff\xfe",
    b"1e400",
    b"-1",
    b"18446744073709551616",
    b"\"\"",
    b"null",
    b"[]",
    b"{}",
    b"::=",
    b"(?:",
    b"\\",
)


def mutate(rng: random.Random, seeds: Sequence[bytes]) -> bytes:
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randint(0, len(data))
        if op == 0 and data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[pos:pos] = rng.choice(TOKENS)
        elif op == 2:
            del data[pos : pos + rng.randint(1, 16)]
        elif op == 3:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4:
            other = rng.choice(seeds)
            cut = rng.randint(0, len(other))
            data = data[:pos] + bytearray(other[cut:])
        else:
            data = data[:pos]
    return bytes(data)


def inputs(seeds: Sequence[bytes], n: int, seed: int = 0) -> Iterator[bytes]:
    """The seeds, then mutants of them: n inputs in all."""
    rng = random.Random(seed)
    for i in range(n):
        yield seeds[i] if i < len(seeds) else mutate(rng, seeds)
