"""The model checker (formal/) over the runtime's own protocol: the small configuration holds,
every mutation twin yields a counterexample, and each runtime finding is still reproduced."""

from __future__ import annotations

from dataclasses import replace

import pytest

from formal import model as fm
from formal.configs import config_for
from formal.explorer import Result, explore
from kvfence.engine import admission
from kvfence.pd import glue, protocol
from kvfence.tools.check_protocol import main

FIXED = frozenset(fm.FINDINGS)
STATE_FLOOR = 5_000  # the small configuration reaches ~10k worlds; an explorer that visits
# nothing (or forgets faults) falls far below


NO_REPLAY = tuple((k, 0 if k == "dup" else 1) for k in fm.FAULTS)


# The small configuration without decode's cached prefix: the twins of the transfer's own
# guards need no cache, and the cache triples the states (CI time). The cache's own runs
# (all invariants hold, its twins) use the small configuration as it is.
SMALL = config_for("small")
UNCACHED = tuple(replace(spec, cached=0) for spec in SMALL.requests)


def check(cache: bool = False, **kw: object) -> tuple[fm.Model, Result]:
    requests = SMALL.requests if cache else UNCACHED
    cfg = replace(SMALL, requests=requests, assume_fixed=FIXED, **kw)  # type: ignore[arg-type]
    m = fm.Model(cfg)
    return m, explore(m)


def test_formal_drives_the_runtime_functions_not_copies() -> None:
    assert fm.decode_step is protocol.decode_step
    assert fm.prefill_step is protocol.prefill_step
    assert fm.prefill_open is protocol.prefill_open
    assert fm.admit is admission.admit
    assert fm.p is protocol
    # ... and the runtime's glue around them: pd/decode.py and pd/prefill.py call these too.
    assert fm.decode_feed is glue.decode_feed
    assert fm.prefill_start is glue.prefill_start
    assert fm.prefill_feed is glue.prefill_feed


def test_small_configuration_all_invariants_hold() -> None:
    _, res = check(cache=True)
    assert res.ok, {k: c.message for k, c in res.found.items()}
    assert res.complete
    assert res.states > STATE_FLOOR
    assert res.transitions > res.states
    assert res.max_depth >= 20


def test_no_fifo_keeps_safety_over_tcp_but_not_progress() -> None:
    # The tcp receiver refuses writes to rooms it closed, so reordering costs only liveness.
    _, res = check(fifo=False)
    assert set(res.found) == {"L"}


@pytest.mark.parametrize(
    ("guard", "transport", "breaks"),
    [
        ("admission", "tcp", {"I1", "I5"}),  # a rejected prompt reaches prefill, gets a 200
        ("count_check", "tcp", {"I3", "I2", "I5"}),  # truncated transfer commits, stale page read
        ("checksum", "tcp", {"I3", "I2", "I5"}),  # corrupted page commits and is read
        ("abort_ack", "tcp", {"L"}),  # every abort then waits for a timeout
        ("tag_check", "tcp", {"I4", "I2", "I5"}),  # a late page lands in a reused page
        # Only a one-sided write cannot be vetoed by the receiver: that is where it matters.
        ("deferred_release", "mooncake", {"I4", "I2", "I5"}),
    ],
)
def test_i_mutation_twin_finds_a_counterexample(guard: str, transport: str, breaks: set) -> None:
    kw: dict = {"transport": transport}
    if transport == "mooncake":
        kw["faults"] = NO_REPLAY  # a replayed RESERVE breaks mooncake on its own (I8's job)
    _, base = check(**kw)
    _, twin = check(off=frozenset({guard}), **kw)
    assert not twin.ok
    assert breaks <= set(twin.found), twin.found.keys()
    # The twin's reads of foreign KV are the guard's doing: the baseline has none.
    assert not {"I2", "I3", "I5", "L"} & set(base.found), base.found.keys()
    for cx in twin.found.values():
        assert cx.trace, "a counterexample has at least one step"


@pytest.mark.parametrize(
    ("guard", "breaks"),
    [
        # A cached page a live room references is evicted under it (I4), then named (I2).
        ("prefix_pin", {"I4", "I2"}),
        # Decode's cache hands r0 other KV and prefill takes the claim: committed and read.
        ("prefix_digest", {"I3", "I2", "I5"}),
    ],
)
def test_prefix_cache_mutation_twin_finds_a_counterexample(guard: str, breaks: set) -> None:
    # The baseline with the cache is test_small_configuration_all_invariants_hold.
    _, twin = check(cache=True, off=frozenset({guard}))
    assert breaks <= set(twin.found), twin.found.keys()
    assert all(cx.trace for cx in twin.found.values())


def test_i2_placeholder_twin_reads_another_requests_page() -> None:
    _, res = check(placeholder=True)
    assert {"I1", "I2", "I3", "I5"} <= set(res.found)
    assert res.first() is not None and res.first().invariant == "I1"
    i2 = res.found["I2"]
    assert "decode of r2" in i2.message and "holding" in i2.message
    assert "earlier request" in i2.message or "KV of r" in i2.message
    assert any("decode runs r2" in s.label for s in i2.trace)


def test_runtime_fixes_hold_with_nothing_assumed() -> None:
    """The checker's findings are fixed in the runtime (and mirrored in the model's glue):
    prefill ignores the ack of its own ABORT, so no message drops the connection (W)."""
    res = explore(fm.Model(replace(SMALL, requests=UNCACHED, assume_fixed=frozenset())))
    assert res.ok, res.found


def test_mooncake_sources_are_freed_only_after_the_one_sided_write() -> None:
    """Was a finding: prefill released a SENDING room's source pages on ABORT or timeout while
    its one-sided write could still read them. Now the release waits for the write."""
    _, res = check(transport="mooncake", faults=NO_REPLAY)
    assert res.ok, res.found


def test_mooncake_collision_abort_fences_the_live_room() -> None:
    """Was a finding: a replayed RESERVE got ABORT(room_collision) that decode took as the live
    room's fence while prefill's live room kept writing. Replays included, it holds now."""
    _, res = check(transport="mooncake")
    assert res.ok, res.found


def test_cli_exit_codes_and_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--assume-fixed", "all"]) == 0
    out = capsys.readouterr().out
    assert "states explored:" in out and "all invariants hold" in out
    assert main(["--assume-fixed", "all", "--without", "checksum"]) == 1
    out = capsys.readouterr().out
    assert "violated" in out and "trace:" in out and "corrupted" in out


def test_the_model_checker_ships_in_the_wheel() -> None:
    """`kvfence check-protocol` imports formal/: the distribution's package list (pyproject.toml)
    must take it along with kvfence, or the command fails from an installed wheel."""
    import tomllib
    from pathlib import Path

    from setuptools import find_namespace_packages

    repo = Path(__file__).resolve().parent.parent
    find = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    shipped = find_namespace_packages(str(repo), include=find["find"]["include"])
    assert "formal" in shipped and "kvfence.tools" in shipped
    assert not any(p.startswith(("tests", "benchmarks", "scripts")) for p in shipped)
