"""The PD handshake against an attacker on the network (I8): a Dolev-Yao style model, explored
breadth-first, separate from the transfer model (formal/model.py) because its subject is who can
say what to whom, not what pages do.

The attacker carries every message: it records each one, may deliver any recorded message to any
party, any number of times, and may build messages from what it holds (its own nonces and keys,
and, to be strong, a certificate of the cluster CA of the *decode* role: an insider's key). It
cannot forge a MAC or a signature under a key it does not hold, nor read an encrypted frame of a
session whose key it does not hold.

Two handshakes:
- legacy: HELLO(nc) and HELLO_OK(ns) under the cluster's hello key (a MAC that binds nothing
  of the other side), then session keys from (nc, ns); frames authenticated, not encrypted.
- tls: TLS 1.3 with mutual certificates, abstracted: the server's CertificateVerify signs the
  transcript (the client's nonce included) under its certified key; the client accepts only a
  signature chaining to the cluster CA (peer_verify), whose certificate names the prefill role
  (role_check), over its own nonce (transcript); records under keys only the two ends hold.
  Each of the three can be removed (a mutation twin) to see what it carries.

Properties, checked in every reachable state, for every decode session that sent its RESERVE:
- agreement: a prefill session answered *this* session's hello (same nonces, signed by the
  prefill): the decode talks to the prefill it thinks it does, in this connection;
- secrecy: the attacker never reads a RESERVE (tenant and prompt tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

HANDSHAKES = ("legacy", "tls")
TLS_GUARDS = ("peer_verify", "role_check", "transcript")
PROPERTIES = {
    "agreement": "a RESERVE goes only to the prefill session that answered this connection",
    "secrecy": "the attacker never reads a RESERVE (tenant, prompt tokens)",
}
# Signers: the prefill (cluster CA, prefill role), the attacker's insider decode certificate
# (cluster CA, decode role) and the attacker's own CA.
PREFILL, INSIDER, ROGUE = "prefill", "attacker(decode cert)", "attacker(own CA)"
ATTACKER_NONCE = "a0"


class Term(NamedTuple):
    kind: str  # hello | hello_ok | client_hello | server_hello | reserve
    nc: str = ""  # the client's nonce (what the message carries or signs)
    ns: str = ""  # the server's nonce
    signer: str = ""  # who keyed or signed it


class DSession(NamedTuple):
    nonce: str
    state: str  # hello_sent | accepted | reserved
    ns: str = ""
    signer: str = ""


@dataclass(frozen=True)
class World:
    decode: tuple[DSession, ...] = ()
    prefill: tuple[tuple[str, str], ...] = ()  # (nc, ns) of each hello a prefill answered
    known: frozenset[Term] = frozenset()  # everything the attacker recorded or read


@dataclass
class Config:
    handshake: str = "tls"
    off: frozenset[str] = frozenset()
    decode_sessions: int = 2
    prefill_sessions: int = 2


@dataclass
class Counterexample:
    prop: str
    message: str
    trace: list[str]


@dataclass
class Result:
    states: int = 0
    found: dict[str, Counterexample] = field(default_factory=dict)


class HandshakeModel:
    def __init__(self, cfg: Config) -> None:
        if cfg.handshake not in HANDSHAKES:
            raise ValueError(f"unknown handshake {cfg.handshake!r}")
        if cfg.off - set(TLS_GUARDS) or (cfg.off and cfg.handshake != "tls"):
            raise ValueError(f"the tls handshake's guards are {TLS_GUARDS}")
        self.cfg = cfg
        self.tls = cfg.handshake == "tls"

    # ---- what each party does ------------------------------------------------------------

    def _hello(self, nc: str) -> Term:
        return Term("client_hello", nc) if self.tls else Term("hello", nc, signer="hello-key")

    def _answer(self, hello: Term, ns: str) -> Term:
        if self.tls:
            return Term("server_hello", hello.nc, ns, PREFILL)  # signs the transcript
        return Term("hello_ok", "", ns, "hello-key")  # binds nothing of the hello

    def _decode_accepts(self, s: DSession, t: Term) -> bool:
        if not self.tls:
            return t.kind == "hello_ok" and t.signer == "hello-key"
        if t.kind != "server_hello":
            return False
        on = self.cfg.off.isdisjoint
        chains = t.signer in (PREFILL, INSIDER) or not on({"peer_verify"})
        role_ok = t.signer == PREFILL or not on({"peer_verify", "role_check"})
        # Without verification the signature is still checked against whatever key the
        # certificate holds: the transcript binding stays unless it is the twin removed.
        fresh = t.nc == s.nonce or not on({"transcript"})
        return chains and role_ok and fresh

    def _forgeable(self, w: World) -> set[Term]:
        """Replies the attacker can build itself: none under the hello key; server hellos
        signed by its own keys over any nonce it has seen."""
        if not self.tls:
            return set()
        seen = {t.nc for t in w.known if t.nc} | {ATTACKER_NONCE}
        return {
            Term("server_hello", nc, ATTACKER_NONCE, who) for nc in seen for who in (INSIDER, ROGUE)
        }

    def _reserve_readable(self, s: DSession) -> bool:
        # legacy frames are plaintext; a TLS session is readable only by its key holder.
        return not self.tls or s.signer != PREFILL

    # ---- the state space -----------------------------------------------------------------

    def successors(self, w: World) -> list[tuple[str, World]]:
        out: list[tuple[str, World]] = []
        if len(w.decode) < self.cfg.decode_sessions:
            nc = f"c{len(w.decode)}"
            hello = self._hello(nc)
            out.append(
                (
                    f"decode opens connection {len(w.decode)}: sends {_show(hello)}",
                    World(w.decode + (DSession(nc, "hello_sent"),), w.prefill, w.known | {hello}),
                )
            )
        if len(w.prefill) < self.cfg.prefill_sessions:
            for hello in sorted(t for t in w.known if t.kind in ("hello", "client_hello")):
                ns = f"s{len(w.prefill)}"
                reply = self._answer(hello, ns)
                out.append(
                    (
                        f"attacker delivers {_show(hello)} to prefill; it answers {_show(reply)}",
                        World(w.decode, w.prefill + ((hello.nc, ns),), w.known | {reply}),
                    )
                )
        replies = {t for t in w.known if t.kind in ("hello_ok", "server_hello")}
        for i, s in enumerate(w.decode):
            if s.state == "hello_sent":
                for t in sorted(replies | self._forgeable(w)):
                    if self._decode_accepts(s, t):
                        src = "delivers recorded" if t in w.known else "forges"
                        acc = s._replace(state="accepted", ns=t.ns, signer=t.signer)
                        d = _set(w.decode, i, acc)
                        out.append(
                            (
                                f"attacker {src} {_show(t)} to decode connection {i}: accepted",
                                World(d, w.prefill, w.known | {t}),
                            )
                        )
            elif s.state == "accepted":
                d = _set(w.decode, i, s._replace(state="reserved"))
                leak = {Term("reserve", s.nonce, s.ns)} if self._reserve_readable(s) else set()
                out.append(
                    (
                        f"decode sends RESERVE on connection {i}"
                        + (" (the attacker reads it)" if leak else ""),
                        World(d, w.prefill, w.known | leak),
                    )
                )
        return out

    def violations(self, w: World) -> list[tuple[str, str]]:
        out = []
        for i, s in enumerate(w.decode):
            if s.state != "reserved":
                continue
            signer_ok = not self.tls or s.signer == PREFILL
            if (s.nonce, s.ns) not in w.prefill or not signer_ok:
                out.append(
                    (
                        "agreement",
                        f"decode connection {i} (nonce {s.nonce}) sent its RESERVE after a reply "
                        f"(server nonce {s.ns}, from {s.signer}) no prefill gave to this hello",
                    )
                )
            if Term("reserve", s.nonce, s.ns) in w.known:
                out.append(("secrecy", f"the attacker read connection {i}'s RESERVE"))
        return out


def explore(model: HandshakeModel) -> Result:
    start = World()
    parent: dict[World, tuple[World, str] | None] = {start: None}
    queue = deque([start])
    res = Result()
    while queue:
        w = queue.popleft()
        for prop, message in model.violations(w):
            if prop not in res.found:
                res.found[prop] = Counterexample(prop, message, _trace(parent, w))
        for label, nxt in model.successors(w):
            if nxt not in parent:
                parent[nxt] = (w, label)
                queue.append(nxt)
    res.states = len(parent)
    return res


def render(cx: Counterexample) -> str:
    lines = [f"{cx.prop} violated ({PROPERTIES[cx.prop]}):", f"  {cx.message}", "trace:"]
    lines += [f"  {n:2d}. {step}" for n, step in enumerate(cx.trace, 1)]
    return "\n".join(lines)


def _trace(parent: dict[World, tuple[World, str] | None], w: World) -> list[str]:
    steps = []
    link = parent[w]
    while link is not None:
        w, label = link
        steps.append(label)
        link = parent[w]
    return steps[::-1]


def _set(t: tuple[DSession, ...], i: int, v: DSession) -> tuple[DSession, ...]:
    return t[:i] + (v,) + t[i + 1 :]


def _show(t: Term) -> str:
    if t.kind == "hello":
        return f"HELLO({t.nc})"
    if t.kind == "hello_ok":
        return f"HELLO_OK({t.ns})"
    if t.kind == "client_hello":
        return f"ClientHello({t.nc})"
    return f"ServerHello+CertificateVerify({t.nc}, {t.ns}; signed by {t.signer})"
