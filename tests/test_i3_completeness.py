"""I3: decode commits transferred KV only if counts and checksums match what it reserved and
what prefill computed. Each test has a twin that turns the guard off: the breach goes through."""

from __future__ import annotations

import pytest
from conftest import random_prompts
from pd_harness import PDPair

from kvfence.engine.request import FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = random_prompts([50], vocab=256, seed=8)[0]  # 4 pages of 16


def run(
    model_dir: str,
    fault: str,
    code: str = "kv_transfer_incomplete",
    also: tuple[str, ...] = (),
) -> None:
    """also: more fault points, e.g. the skip_* points that turn guards off (the twins)."""
    pair = PDPair(model_dir, kv_pool_tokens=512, context_length=128)
    try:
        with pair.faults.injected(fault, *also):
            [r] = pair.generate([PROMPT], GREEDY)
        assert r.final.finish_reason is FinishReason.ERROR, "a bad transfer was committed"
        assert r.final.error_code == code
        assert r.token_ids == []
        assert pair.wait_idle(), pair.pages_used()
    finally:
        pair.close()


@pytest.fixture(scope="module")
def model_dir(checkpoint_dir) -> str:
    return str(checkpoint_dir("llama"))


def test_i3_corrupted_page_fails_closed(model_dir: str) -> None:
    run(model_dir, "corrupt_page")


def test_i3_twin_without_checksums_corruption_is_committed(model_dir: str) -> None:
    with pytest.raises(AssertionError, match="committed"):
        run(model_dir, "corrupt_page", also=("skip_checksum",))


def test_i3_truncated_transfer_fails_closed(model_dir: str) -> None:
    run(model_dir, "truncate_transfer")


NO_COUNTS = ("skip_count_check", "skip_checksum")


def test_i3_without_counts_the_tag_check_still_refuses_unwritten_pages(model_dir: str) -> None:
    # Defense in depth: the three pages nobody wrote hold no data of this grant (I2's check).
    run(model_dir, "truncate_transfer", code="kv_integrity_error", also=NO_COUNTS)


def test_i3_twin_without_counts_or_tags_truncation_is_committed(model_dir: str) -> None:
    # With all three off, decode attends to three pages nobody wrote: the incident's stale read.
    with pytest.raises(AssertionError, match="committed"):
        run(model_dir, "truncate_transfer", also=(*NO_COUNTS, "skip_tag_check"))
