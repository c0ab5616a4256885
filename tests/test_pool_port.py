"""The PD pool port (kvfence/pd/pool_port.py): the one way from a PD service's IO loop and
transport threads into the engine's KVPool. Its rule is code: a call from the wrong thread, or on
a grant the PD side does not hold (not parked in HANDOFF and handed over), raises, and a room
whose pages the port does not hold fails closed. The twin turns the rule off (`skip_port_rule`)
and shows each breach then lands unnoticed. And no other module of kvfence/pd reaches the pool.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, random_prompts
from pd_harness import PDPair, Result, finished_ok

from kvfence.engine.request import FinishReason, SamplingParams
from kvfence.kv.pool import Grant
from kvfence.pd import kvio
from kvfence.pd.pool_port import PortRuleBroken

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PD = Path(__file__).resolve().parent.parent / "kvfence" / "pd"
WAIT_S = 60


def _pair() -> PDPair:
    return PDPair(str(TINY_MODEL), kv_pool_tokens=512, context_length=128)


def _breaches(pair: PDPair) -> dict[str, object]:
    """Each breach of the rule, tried once: what it raised (None: nothing), and what it did."""
    decode = pair.decode
    real = decode.on_reserved
    seen: dict[str, object] = {}

    def on_reserved(seq) -> None:  # the engine thread, the sequence just parked in HANDOFF
        real(seq)
        seen["grant"], seen["pages"] = seq.grant, list(seq.pages)
        try:  # a PD-side call from the engine thread
            decode.pool_port.check_destination(seq.grant, seq.pages)
            seen["engine_thread_call"] = None
        except PortRuleBroken as e:
            seen["engine_thread_call"] = e

    decode.on_reserved = on_reserved  # type: ignore[method-assign]
    try:
        r = pair.generate([random_prompts([20], 256, seed=3)[0]], PARAMS)[0]
    finally:
        decode.on_reserved = real  # type: ignore[method-assign]
    seen["answer"] = r
    assert pair.wait_idle(WAIT_S), "the pair never went idle"
    grant, pages = seen["grant"], seen["pages"]
    assert isinstance(grant, Grant) and isinstance(pages, list)
    view, first = decode.pool_port.view, pages[:1]
    junk = torch.full(
        (2, view.num_layers, 1, view.page_size * kvio.token_bytes(view)), 0x7F, dtype=torch.uint8
    )
    before = kvio.pool_checksums(view, first, view.page_size)
    try:  # a write after the room committed: the engine owns those pages again
        decode.pool_port.write(grant, first, view.page_size, junk, None)
        seen["after_commit"] = None
    except PortRuleBroken as e:
        seen["after_commit"] = e
    seen["landed"] = kvio.pool_checksums(view, first, view.page_size) != before
    try:  # an engine-side call from another thread
        decode.pool_port.hand_over(grant)
        seen["other_thread_hand_over"] = None
    except PortRuleBroken as e:
        seen["other_thread_hand_over"] = e
    return seen


def _room_not_handed_over(pair: PDPair) -> Result:
    """A decode whose room's grant is taken back from the port right after on_reserved handed it
    over (a service bug): every PD-side call of the room is then on a grant the port does not
    hold."""
    decode = pair.decode
    real = decode.on_reserved

    def on_reserved(seq) -> None:
        real(seq)
        decode.pool_port._drop(seq.grant)

    decode.on_reserved = on_reserved  # type: ignore[method-assign]
    try:
        _, r = pair.submit(random_prompts([20], 256, seed=4)[0], PARAMS)
        assert isinstance(r, Result) and r.done.wait(WAIT_S), "the request never finished"
    finally:
        decode.on_reserved = real  # type: ignore[method-assign]
    assert pair.wait_idle(WAIT_S), "the pages never went back"
    return r


def _prefill_room_not_handed_over(pair: PDPair) -> Result:
    """The same on prefill's side: the room's grant is taken back from the port on the IO loop
    before its pages are sent."""
    prefill = pair.prefill
    real = prefill._prefilled

    def prefilled(seq) -> None:
        prefill.pool_port._drop(seq.grant)
        real(seq)

    prefill._prefilled = prefilled  # type: ignore[method-assign]
    try:
        _, r = pair.submit(random_prompts([20], 256, seed=5)[0], PARAMS)
        assert isinstance(r, Result) and r.done.wait(WAIT_S), "the request never finished"
    finally:
        prefill._prefilled = real  # type: ignore[method-assign]
    assert pair.wait_idle(WAIT_S), "the pages never went back"
    return r


def test_pool_port_refuses_the_wrong_thread_and_a_grant_it_does_not_hold() -> None:
    pair = _pair()
    try:
        seen = _breaches(pair)
        assert isinstance(seen["engine_thread_call"], PortRuleBroken)
        assert isinstance(seen["after_commit"], PortRuleBroken)
        assert not seen["landed"]  # refused before a byte was written
        assert isinstance(seen["other_thread_hand_over"], PortRuleBroken)
        assert finished_ok(seen["answer"])  # type: ignore[arg-type]
    finally:
        pair.close()


def test_pool_port_a_room_whose_grant_it_does_not_hold_fails_closed() -> None:
    pair = _pair()
    try:
        r = _room_not_handed_over(pair)
        assert r.final is not None and r.final.finish_reason is FinishReason.ERROR
        assert r.token_ids == []  # the client heard an error, never a token
        assert pair.decode.transfer_stats.get("port_rule_broken") == 1
        assert pair.decode.transfer_stats.get("transfers_committed") == 0
        sent = pair.prefill.transfer_stats.get("pages_sent")
        r = _prefill_room_not_handed_over(pair)
        assert r.final is not None and r.final.finish_reason is FinishReason.ERROR
        assert r.token_ids == []
        assert pair.prefill.transfer_stats.get("port_rule_broken") == 1
        assert pair.prefill.transfer_stats.get("pages_sent") == sent  # not a page left
    finally:
        pair.close()


def test_pool_port_twin_without_the_rule_every_breach_lands() -> None:
    pair = _pair()
    try:
        with pair.faults.injected("skip_port_rule"):
            seen = _breaches(pair)
            r = _room_not_handed_over(pair)
            sent = _prefill_room_not_handed_over(pair)
        assert seen["engine_thread_call"] is None
        assert seen["after_commit"] is None and seen["landed"]
        assert seen["other_thread_hand_over"] is None
        # The room's pages were written and committed by a side that did not hold them.
        assert finished_ok(r) and finished_ok(sent)
        assert pair.decode.transfer_stats.get("port_rule_broken") == 0
        assert pair.prefill.transfer_stats.get("port_rule_broken") == 0
    finally:
        pair.close()


def _reaches_the_pool(path: Path) -> list[str]:
    """Where a module names KVPool or reads a `.pool` attribute (engine.pool, runner.pool ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "pool":
            found.append(f"{path.name}:{node.lineno} .pool")
        elif isinstance(node, ast.Name) and node.id == "KVPool":
            found.append(f"{path.name}:{node.lineno} KVPool")
        elif isinstance(node, ast.alias) and node.name == "KVPool":
            found.append(f"{path.name}: imports KVPool")
    return found


def test_only_the_pool_port_reaches_the_pool() -> None:
    files = sorted(PD.rglob("*.py"))
    assert PD / "pool_port.py" in files and len(files) > 10
    found = [hit for f in files if f.name != "pool_port.py" for hit in _reaches_the_pool(f)]
    assert found == [], f"kvfence/pd reaches the pool outside pool_port.py: {found}"


@pytest.mark.parametrize(
    "source",
    ["x = self.engine.pool.page_size", "from kvfence.kv.pool import KVPool", "p: KVPool"],
)
def test_twin_the_pool_check_sees_a_module_reaching_the_pool(tmp_path, source: str) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(source + "\n")
    assert _reaches_the_pool(bad)
