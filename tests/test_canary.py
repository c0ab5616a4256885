"""Canary markers: `find_leaks` catches whole and 8-char foreign pieces, never own canaries,
7-char pieces or ordinary text, and tells cross-tenant from same-tenant leaks; prompts hit
their token target and cue one of their own canaries."""

from __future__ import annotations

import random

import pytest
from conftest import TINY_MODEL
from tokenizers import Tokenizer

from kvfence.tools.canary import (
    ALPHABET,
    BODY_LEN,
    MIN_FRAGMENT,
    PREFIX,
    CanaryRegistry,
    approx_counter,
    build_prompt,
)

ENGLISH = """It was the best of times, it was the worst of times, it was the age of wisdom, it was
the age of foolishness, it was the epoch of belief, it was the epoch of incredulity. The Quick
Brown Fox Jumps Over The Lazy Dog 1234567890 ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnop
HTTP/1.1 200 OK Content-Type: application/json; X-Request-Id: 7f3a9c2e-11d4 SHA256 BASE64
"""


@pytest.fixture()
def reg() -> CanaryRegistry:
    r = CanaryRegistry(random.Random(7))
    for tenant, rid in [("alpha", "a1"), ("alpha", "a2"), ("beta", "b1")]:
        for _ in range(50):
            r.mint(tenant, rid)
    return r


def test_canary_shape_and_uniqueness(reg: CanaryRegistry) -> None:
    canaries = reg.canaries_of("a1") + reg.canaries_of("a2") + reg.canaries_of("b1")
    assert len(set(canaries)) == len(canaries) == 150 == len(reg)
    for c in canaries:
        assert c.startswith(PREFIX) and len(c) == len(PREFIX) + BODY_LEN
        assert set(c[len(PREFIX) :]) <= set(ALPHABET)
    assert reg.owner(canaries[0]).request_id == "a1"


def test_whole_foreign_canary_is_a_cross_tenant_leak(reg: CanaryRegistry) -> None:
    foreign = reg.canaries_of("b1")[3]
    leaks = reg.find_leaks(f"the answer is {foreign} thanks", "a1")
    assert len(leaks) == 1
    leak = leaks[0]
    assert leak.canary == foreign and leak.whole and leak.cross_tenant
    assert (leak.owner_request_id, leak.owner_tenant) == ("b1", "beta")
    assert (leak.reader_request_id, leak.reader_tenant) == ("a1", "alpha")
    assert leak.kind == "cross_tenant" and leak.as_dict()["fragment"] == foreign[len(PREFIX) :]


def test_eight_char_piece_is_a_leak_seven_is_not(reg: CanaryRegistry) -> None:
    body = reg.canaries_of("b1")[0][len(PREFIX) :]
    piece8 = body[5 : 5 + MIN_FRAGMENT]
    [leak] = reg.find_leaks(f"xx {piece8} yy", "a1")
    assert leak.fragment == piece8 and not leak.whole
    assert reg.find_leaks(f"xx {piece8.lower()} yy", "a1"), "case-folded echo still counts"
    assert reg.find_leaks(f"xx {body[5 : 5 + MIN_FRAGMENT - 1]} yy", "a1") == []
    # Two 7-char pieces from different places do not join into a false 8-char piece.
    assert reg.find_leaks(body[:7] + "-" + body[9:16], "a1") == []


def test_same_tenant_other_request_is_its_own_kind(reg: CanaryRegistry) -> None:
    [leak] = reg.find_leaks(reg.canaries_of("a2")[0], "a1")
    assert not leak.cross_tenant and leak.kind == "same_tenant_other_request"


def test_own_canaries_are_fine(reg: CanaryRegistry) -> None:
    own = reg.canaries_of("a1")
    assert reg.find_leaks(" ".join(own), "a1") == []
    assert reg.echoed_own(own[10], "a1") and not reg.echoed_own(own[10], "a2")


def test_prefix_alone_is_never_a_leak(reg: CanaryRegistry) -> None:
    c = reg.canaries_of("b1")[0]
    assert reg.find_leaks(c[: len(PREFIX) + MIN_FRAGMENT - 1], "a1") == []


def test_several_leaks_in_one_output_are_each_reported(reg: CanaryRegistry) -> None:
    out = reg.canaries_of("b1")[1] + "\n" + reg.canaries_of("a2")[2][4:14]
    leaks = {leak.owner_request_id: leak for leak in reg.find_leaks(out, "a1")}
    assert set(leaks) == {"b1", "a2"}
    assert leaks["b1"].whole and not leaks["a2"].whole


def test_no_false_positives_on_english_and_random_text() -> None:
    reg = CanaryRegistry(random.Random(11))
    for i in range(2000):
        reg.mint("t", f"r{i}")
    reg.register("u", "reader")
    rng = random.Random(3)
    noise = "".join(rng.choice(ALPHABET + " \n") for _ in range(20_000))
    assert reg.find_leaks(ENGLISH * 20 + noise, "reader") == []


def test_bare_cue_owns_nothing_and_any_canary_in_its_output_is_foreign() -> None:
    reg = CanaryRegistry(random.Random(1))
    full = build_prompt(reg, "alpha", "a", 200, rng=random.Random(2))
    bare = build_prompt(reg, "beta", "b", 120, rng=random.Random(3), records=False)
    assert bare.canaries == () and bare.expected is None and PREFIX not in bare.text
    [leak] = reg.find_leaks(f" {full.expected}\n", "b")
    assert leak.cross_tenant and leak.owner_request_id == "a"


def test_prompt_hits_its_target_and_cues_its_own_canary() -> None:
    tok = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))

    def count(s: str) -> int:
        return len(tok.encode(s).ids)

    reg = CanaryRegistry(random.Random(5))
    rng = random.Random(6)
    for target in (40, 257, 1023, 1024, 1025):
        p = build_prompt(reg, "alpha", f"r{target}", target, rng=rng, count_tokens=count)
        assert count(p.text) == p.tokens == target
        assert p.text.endswith(p.cue) and p.cue.endswith(":")
        assert p.expected in p.canaries and f"\n{p.cue} {p.expected}\n" in "\n" + p.text
        assert reg.canaries_of(f"r{target}") == list(p.canaries)  # nothing trimmed is owned
        stepped = p.padded(p.pad + 3)
        newline = 1 if p.pad == 0 else 0  # the pad sits on its own line
        assert count(stepped.text) == stepped.tokens == target + 3 + newline
        assert stepped.canaries == p.canaries


def test_approximate_counter_stays_under_target_for_canary_text() -> None:
    tok = Tokenizer.from_file(str(TINY_MODEL / "tokenizer.json"))
    reg = CanaryRegistry(random.Random(8))
    p = build_prompt(reg, "t", "r", 1000, rng=random.Random(9), count_tokens=approx_counter())
    assert p.tokens <= 1000 and len(tok.encode(p.text).ids) <= 1000
