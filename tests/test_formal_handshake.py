"""I8's handshake against a network attacker that records, replays and forges (formal/
handshake.py): the old HELLO-MAC handshake yields the replay counterexample of issue 15 (a
recorded HELLO_OK makes a decode send its RESERVE to someone no prefill vouched for, and in
clear); the TLS handshake yields none; each of its guards, removed, yields one."""

from __future__ import annotations

import pytest

from formal import handshake as hs
from kvfence.tools.check_protocol import main


def explore(handshake: str, *off: str) -> hs.Result:
    return hs.explore(hs.HandshakeModel(hs.Config(handshake, frozenset(off))))


def test_i8_legacy_handshake_replay_is_a_counterexample() -> None:
    res = explore("legacy")
    assert set(res.found) == {"agreement", "secrecy"}
    trace = res.found["agreement"].trace
    assert any("delivers recorded HELLO_OK" in step for step in trace), trace
    assert trace[-1].startswith("decode sends RESERVE")


def test_i8_tls_handshake_holds_against_the_attacker() -> None:
    res = explore("tls")
    assert res.found == {}
    assert res.states > 20  # the attacker's moves were explored, not skipped


@pytest.mark.parametrize(
    "guard, breaks",
    [
        ("peer_verify", {"agreement", "secrecy"}),  # any certificate: the attacker's own CA
        ("role_check", {"agreement", "secrecy"}),  # a stolen decode key poses as a prefill
        ("transcript", {"agreement"}),  # a recorded server signature replays
    ],
)
def test_i8_tls_handshake_twin_finds_a_counterexample(guard: str, breaks: set) -> None:
    assert set(explore("tls", guard).found) == breaks


def test_i8_check_protocol_handshake_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--handshake", "legacy"]) == 1
    assert "delivers recorded HELLO_OK" in capsys.readouterr().out
    assert main(["--handshake", "tls"]) == 0
    assert "all properties hold" in capsys.readouterr().out
    assert main(["--handshake", "tls", "--without", "transcript"]) == 1
    assert main(["--handshake", "legacy", "--without", "transcript"]) == 2
