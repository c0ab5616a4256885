"""RunArrived (a PageRun frame's pages in one decode transition) is exactly the fold of its
pages' PageArrived events, and the transfer stats keep per-room phase marks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfence.pd import protocol as p
from kvfence.pd.stats import MARKED_ROOMS, TransferStats

pages = st.lists(
    st.builds(p.PageArrived, st.integers(0, 7), st.just(16), st.integers(0, 99), st.booleans()),
    max_size=8,
)


@given(st.lists(pages, max_size=4))
def test_run_arrived_is_the_fold_of_page_arrived(runs: list[list[p.PageArrived]]) -> None:
    by_page = by_run = p.DecodeRoom("r", 32, 2)
    for run in runs:
        for event in run:
            by_page, a = p.decode_step(by_page, event)
            assert a == ()
        by_run, a = p.decode_step(by_run, p.RunArrived(tuple(run)))
        assert a == ()
    assert by_run == by_page


def test_run_arrived_after_the_end_changes_nothing() -> None:
    room = p.DecodeRoom("r", 16, 1, state=p.DState.ABORTING)
    assert p.decode_step(room, p.RunArrived((p.PageArrived(0, 16, 1, False),))) == (room, ())


def test_transfer_marks_keep_the_first_stamp_and_the_newest_rooms() -> None:
    stats = TransferStats("decode")
    assert stats.mark("a", "first_page", 1.0) == 1.0
    assert stats.mark("a", "first_page", 2.0) == 1.0
    for i in range(MARKED_ROOMS):
        stats.mark(f"r{i}", "done_handled", 3.0)
    marks = stats.marks()
    assert "a" not in marks and len(marks) == MARKED_ROOMS
    stats.observe_phase("receive", 0.01)
    names = {m.name for m in stats.metrics(0)}
    assert "kvfence_pd_receive_seconds" in names
