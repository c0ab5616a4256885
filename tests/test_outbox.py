"""StepOutbox: the engine thread's outputs leave as one batch at the end of its step, in order;
any other thread's leave at once, behind whatever was held."""

from __future__ import annotations

import threading

from kvfence.engine.outbox import StepOutbox
from kvfence.engine.request import FinishReason, RequestOutput


def _out(rid: str, finished: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput(rid, (1,), "x", reason, 1, 1)


def _on_thread(fn) -> None:  # type: ignore[no-untyped-def]
    t = threading.Thread(target=fn)
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "the helper thread did not finish in 30 s"


def test_engine_thread_outputs_leave_once_a_step_in_order() -> None:
    batches: list[list[tuple[str, RequestOutput]]] = []
    box: StepOutbox[str] = StepOutbox(batches.append)
    box.step_done()  # this thread is the engine's from now on
    a, b = box.sink("a"), box.sink("b")
    a(_out("1"))
    b(_out("2"))
    a(_out("3", finished=True))
    assert batches == [], "held until the step ends"
    box.step_done()
    assert [[(k, o.request_id) for k, o in batch] for batch in batches] == [
        [("a", "1"), ("b", "2"), ("a", "3")]
    ]
    box.step_done()
    assert len(batches) == 1, "an empty step sends nothing"


def test_other_threads_send_at_once_behind_what_was_held() -> None:
    batches: list[list[tuple[str, RequestOutput]]] = []
    box: StepOutbox[str] = StepOutbox(batches.append)
    box.step_done()
    box.sink("engine")(_out("1"))
    _on_thread(lambda: box.sink("io")(_out("2")))
    assert [[k for k, _ in batch] for batch in batches] == [["engine", "io"]]


def test_before_the_engine_thread_is_known_every_output_leaves_at_once() -> None:
    batches: list[list[tuple[str, RequestOutput]]] = []
    box: StepOutbox[str] = StepOutbox(batches.append)
    box.sink("a")(_out("1"))
    box.sink("a")(_out("2"))
    assert len(batches) == 2
