"""`kvfence check-protocol`: model-check the KV transfer protocol (formal/) in a bounded
configuration and print either "all invariants hold" or the shortest counterexample. With
--handshake, check the PD handshake against a recording, replaying, forging network attacker
instead (formal/handshake.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

TWINS = (
    "admission",
    "count_check",
    "checksum",
    "deferred_release",
    "abort_ack",
    "tag_check",
    "prefix_pin",
    "prefix_digest",
)
HANDSHAKE_TWINS = ("peer_verify", "role_check", "transcript")


def _formal() -> tuple[Any, Any]:
    # formal/ is a package of the kvfence distribution (pyproject.toml), installed beside
    # kvfence; imported only when asked, so `kvfence serve` never loads the model checker.
    import formal.explorer as explorer
    import formal.model as model

    return explorer, model


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvfence check-protocol", description=__doc__)
    ap.add_argument("--config", choices=("small", "medium"), default="small")
    ap.add_argument(
        "--without",
        nargs="+",
        action="extend",
        default=[],
        choices=TWINS + HANDSHAKE_TWINS,
        metavar="GUARD",
        help=f"remove guards (mutation twins): {', '.join(TWINS)}; with --handshake tls: "
        f"{', '.join(HANDSHAKE_TWINS)}",
    )
    ap.add_argument(
        "--handshake",
        choices=("legacy", "tls"),
        default=None,
        help="check the handshake against a network attacker instead: the old HELLO MAC "
        "handshake (legacy) or the TLS 1.3 mutual-certificate one kvfence runs (tls)",
    )
    ap.add_argument(
        "--with-placeholder",
        action="store_true",
        help="the incident's path: a rejected prompt continues as a 1-token placeholder",
    )
    ap.add_argument(
        "--fifo",
        dest="fifo",
        action="store_true",
        default=True,
        help="per-connection order holds (the default; tcp is one ordered stream)",
    )
    ap.add_argument(
        "--no-fifo",
        dest="fifo",
        action="store_false",
        help="drop the ordering assumption: any message or write may arrive any time",
    )
    ap.add_argument("--transport", choices=("tcp", "mooncake"), default="tcp")
    ap.add_argument(
        "--assume-fixed",
        nargs="+",
        action="extend",
        default=[],
        metavar="FINDING",
        help="model these runtime findings as fixed ('all' for every one)",
    )
    ap.add_argument(
        "--all-counterexamples",
        action="store_true",
        help="print the shortest trace of every violated invariant, not just one",
    )
    ap.add_argument("--max-states", type=int, default=None)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.handshake or set(args.without) & set(HANDSHAKE_TWINS):
        return check_handshake(args)
    explorer, model = _formal()
    from formal.configs import config_for

    fixed = set(args.assume_fixed)
    if "all" in fixed:
        fixed = set(model.FINDINGS)
    unknown = fixed - set(model.FINDINGS)
    if unknown:
        print(f"unknown findings {sorted(unknown)}; known: {sorted(model.FINDINGS)}")
        return 2
    cfg = config_for(args.config)
    transport = args.transport
    if "deferred_release" in args.without and transport == "tcp":
        # The tcp receiver refuses a write to a room it released, so early release is harmless
        # there; the guard carries the weight only when writes cannot be vetoed.
        print("note: deferred_release matters only for one-sided writes: checking over mooncake")
        transport = "mooncake"
    cfg = replace(
        cfg,
        off=frozenset(args.without),
        placeholder=args.with_placeholder,
        fifo=args.fifo,
        transport=transport,
        assume_fixed=frozenset(fixed),
    )
    m = model.Model(cfg)
    print(describe(cfg))
    res = explorer.explore(m, max_states=args.max_states)
    print(
        f"states explored: {res.states}, transitions: {res.transitions}, "
        f"max depth: {res.max_depth}, time: {res.seconds:.1f}s"
        + ("" if res.complete else " (stopped at --max-states)")
    )
    if res.ok:
        print("all invariants hold")
        return 0
    print(f"violated: {', '.join(sorted(res.found))}")
    shown = sorted(res.found.values(), key=lambda c: len(c.trace))
    if not args.all_counterexamples:
        # The shortest trace shows the root cause; a foreign or stale read (I2) is what a
        # client would see, so its trace is printed too.
        shown = shown[:1] + [c for c in shown[1:] if c.invariant == "I2"]
    for cx in shown:
        print()
        print(explorer.render(m, cx))
    return 1


def check_handshake(args: argparse.Namespace) -> int:
    import formal.handshake as hs

    off = set(args.without)
    if off - set(HANDSHAKE_TWINS) or (off and args.handshake != "tls"):
        print(f"--without {', '.join(HANDSHAKE_TWINS)} go with --handshake tls, and only they")
        return 2
    cfg = hs.Config(args.handshake, frozenset(off))
    print(
        f"handshake {cfg.handshake}: {cfg.decode_sessions} decode connections, "
        f"{cfg.prefill_sessions} prefill answers, a network attacker that records, replays and "
        "forges (holding a decode certificate of the cluster and a CA of its own)"
        + (f"; without {', '.join(sorted(off))}" if off else "")
    )
    res = hs.explore(hs.HandshakeModel(cfg))
    print(f"states explored: {res.states}")
    if not res.found:
        print("all properties hold: " + "; ".join(hs.PROPERTIES.values()))
        return 0
    print(f"violated: {', '.join(sorted(res.found))}")
    for cx in sorted(res.found.values(), key=lambda c: len(c.trace)):
        print()
        print(hs.render(cx))
    return 1


def describe(cfg: Any) -> str:
    reqs = ", ".join(f"r{i}({s.tenant}, {s.n_tokens} tok)" for i, s in enumerate(cfg.requests))
    faults = ", ".join(f"{k}<={n}" for k, n in cfg.faults if n)
    extra = [f"without {', '.join(sorted(cfg.off))}"] if cfg.off else []
    if cfg.placeholder:
        extra.append("with placeholder")
    if cfg.assume_fixed:
        extra.append(f"assuming fixed: {', '.join(sorted(cfg.assume_fixed))}")
    return (
        f"config {cfg.name}: {reqs}; {cfg.decode_pages} decode / {cfg.prefill_pages} prefill "
        f"pages; context {cfg.context_length}; faults {faults} (at most {cfg.max_faults} per "
        f"run); transport {cfg.transport}; {'fifo' if cfg.fifo else 'no fifo'}"
        + "".join(f"; {e}" for e in extra)
    )


if __name__ == "__main__":
    sys.exit(main())
