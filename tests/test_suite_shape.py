"""The suite's shape stays true: one file per invariant I1-I8, and tests/README.md's table of
invariant -> test -> twin -> fault point names only tests and fault points that exist, and
lists every twin, so the map a reader follows cannot rot."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvfence.faults import POINTS

TESTS = Path(__file__).resolve().parent
ROW = re.compile(
    r"^\| (?P<what>[^|]+) \| `(?P<test>[^`]+)` \| `(?P<twin>[^`]+)` \| (?P<points>.+) \|$"
)


def table_rows() -> list[dict[str, str]]:
    return [m.groupdict() for line in (TESTS / "README.md").read_text().splitlines()
            if (m := ROW.match(line))]


def test_functions(file: str) -> set[str]:
    tree = ast.parse((TESTS / file).read_text())
    return {
        n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")
    }


test_functions.__test__ = False  # a helper, not a test


def listed(ref: str) -> tuple[str, str]:
    file, _, name = ref.partition("::")
    return file, name


def test_every_invariant_has_its_file_and_a_row() -> None:
    rows = table_rows()
    for n in range(1, 9):
        assert list(TESTS.glob(f"test_i{n}_*.py")), f"no tests/test_i{n}_*.py"
        assert any(r["what"] == f"I{n}" for r in rows), f"no row for I{n} in tests/README.md"


@pytest.mark.parametrize("row", table_rows(), ids=lambda r: listed(r["twin"])[1])
def test_each_listed_pair_exists_and_names_real_fault_points(row: dict[str, str]) -> None:
    for ref in (row["test"], row["twin"]):
        file, name = listed(ref)
        assert name in test_functions(file), f"{ref} listed in tests/README.md does not exist"
    points = re.findall(r"`([^`]+)`", row["points"])
    if not row["points"].startswith("none"):
        assert points and set(points) <= POINTS, f"unknown fault point in {row['points']!r}"


def test_the_table_lists_every_test_named_as_a_counterpart() -> None:
    in_table = {listed(r["twin"]) for r in table_rows()}
    named_twin = {(f.name, name) for f in TESTS.glob("test_*.py")
                  for name in test_functions(f.name) if "twin" in name}
    assert named_twin <= in_table, f"twins missing from tests/README.md: {named_twin - in_table}"
