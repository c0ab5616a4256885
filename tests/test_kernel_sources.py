"""The native kernels' sources share one vector type and one way to load and store it
(kvfence/model/kernels/vec16.h). Each kernel once had its own, a 64-byte memcpy, which GCC's
256-bit tuning for some Xeons split through the stack: the packed GEMM ran 4.5x slower than MKL
there (benchmarks/RESULTS.md "Kernels"). Speed itself is measured in benchmarks/, not here."""

from __future__ import annotations

import re
from pathlib import Path

from kvfence.model import kernels

SOURCES = sorted(Path(kernels.__file__).parent.glob("*.cpp"))
VECTOR_TYPE = re.compile(r"vector_size\s*\(")
# memcpy(&a, &b, sizeof a): a whole value copied, the way the old loads were written
VECTOR_COPY = re.compile(r"memcpy\s*\(\s*&?\w+\s*,\s*&?\w+\s*,\s*sizeof\s*\(?\s*\w+\s*\)?\s*\)")


def test_every_kernel_includes_the_one_vector_header() -> None:
    assert len(SOURCES) >= 3
    for src in SOURCES:
        text = src.read_text()
        assert '#include "vec16.h"' in text, f"{src.name} does not include vec16.h"


def test_no_kernel_declares_its_own_vector_type_or_copies_vectors_with_memcpy() -> None:
    for src in SOURCES:
        text = src.read_text()
        assert not VECTOR_TYPE.search(text), f"{src.name} declares a vector type: use vec16.h"
        assert not VECTOR_COPY.search(text), f"{src.name} memcpys a whole value: use vec16.h"


def test_the_guard_sees_the_old_pattern() -> None:
    # The twin: the pattern the kernels used before is caught by the checks above.
    old = "typedef float v16 __attribute__((vector_size(64)));\n__builtin_memcpy(&v, p, sizeof v);"
    assert VECTOR_TYPE.search(old)
    assert VECTOR_COPY.search(old)
