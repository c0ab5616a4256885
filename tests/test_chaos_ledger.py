"""The cache-mix soak's cross-tenant credit check (chaos_mix.Ledger), on hand-made traffic: a
cached page counts as a tenant's own only if its tokens were in the public prefix or in
something that tenant sent before the answer came; any other credit another tenant gave."""

from __future__ import annotations

from kvfence.tools.chaos_mix import Ledger

PAGE = 4
PUBLIC = [1, 2, 3, 4, 5, 6]  # one full page and a part
SYSTEM = [20, 21, 22, 23, 24, 25, 26, 27]  # two pages every tenant sends, not declared public


def _send(ledger: Ledger, tenant: str, prompt: list[int], cached: int) -> None:
    s = ledger.send(tenant, prompt, 0)
    ledger.answer(s, cached, [99])


def test_an_identical_system_prompt_credited_across_tenants_is_a_breach() -> None:
    ledger = Ledger(PUBLIC)
    _send(ledger, "A", SYSTEM + [30, 31, 32, 33], 0)
    _send(ledger, "B", SYSTEM + [40, 41, 42, 43], 8)  # A's two pages, B never sent them
    [breach] = ledger.credit_breaches(PAGE)
    assert (breach["tenant"], breach["cached"], breach["own_pages"]) == ("B", 8, 0)


def test_own_history_and_the_public_prefix_are_no_breach() -> None:
    ledger = Ledger(PUBLIC)
    _send(ledger, "A", SYSTEM + [30, 31, 32, 33], 0)
    _send(ledger, "B", SYSTEM + [40, 41, 42, 43], 0)
    _send(ledger, "B", SYSTEM + [40, 41, 42, 43, 44, 45, 46, 47], 12)  # its own three pages
    _send(ledger, "A", PUBLIC + [50, 51, 52, 53], 0)
    _send(ledger, "C", PUBLIC + [60, 61, 62, 63], 4)  # the public prefix's one full page
    assert ledger.credit_breaches(PAGE) == []


def test_past_the_public_prefix_is_a_breach() -> None:
    ledger = Ledger(PUBLIC)
    _send(ledger, "A", PUBLIC + [50, 51, 52, 53], 0)
    _send(ledger, "C", PUBLIC + [50, 51, 52, 53], 8)  # the page straddling its end is A's
    [breach] = ledger.credit_breaches(PAGE)
    assert (breach["tenant"], breach["own_pages"]) == ("C", 1)


def test_a_credit_only_its_own_prompt_explains_is_no_breach() -> None:
    """Preempted before its first token, a request re-admitted reuses its own sealed pages."""
    ledger = Ledger(PUBLIC)
    _send(ledger, "A", [70, 71, 72, 73, 74, 75, 76, 77, 78], 8)
    assert ledger.credit_breaches(PAGE) == []


def test_repeat_turns_hit_rate_counts_own_pages_past_the_public_prefix() -> None:
    ledger = Ledger(PUBLIC)
    for cached in (4, 8):  # the public page alone is no hit of the conversation's own
        s = ledger.send("A", PUBLIC + [80, 81, 82, 83, 84], 1)
        ledger.answer(s, cached, [1])
    assert ledger.repeat_hit_rate(PAGE) == (2, 1)
