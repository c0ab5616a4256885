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



def _first_token_leaves_before_the_step(checkpoint_dir, send_after_inbox: bool) -> bool:
    """A PD decode shows a prompt's first token at commit, while it drains its inbox, and then
    steps: whether that output had left the outbox when the next forward ran."""
    from kvfence.config import EngineConfig
    from kvfence.engine.engine import Engine
    from kvfence.engine.request import GenerateRequest, SamplingParams

    engine = Engine(EngineConfig(model=str(checkpoint_dir("llama")), kv_pool_tokens=1024))
    if not send_after_inbox:
        engine._send_outputs = lambda: None  # type: ignore[method-assign]
    sent: list[str] = []
    box: StepOutbox[str] = StepOutbox(lambda batch: sent.extend(k for k, _ in batch))
    engine.step_end_hooks.append(box.step_done)
    committed = box.sink("committed")
    shown, at_forward = threading.Event(), []
    drain, run = engine._drain_inbox, engine.runner.run

    def drain_and_commit() -> None:
        drain()
        if not shown.is_set():  # as Engine._commit shows the prefill's first token
            box.engine_thread = threading.current_thread()  # it holds this thread's outputs
            committed(_out("c"))
            shown.set()

    def watched_run(chunks):  # type: ignore[no-untyped-def]
        if shown.is_set() and not at_forward:
            at_forward.append("committed" in sent)
        return run(chunks)

    engine._drain_inbox = drain_and_commit  # type: ignore[method-assign]
    engine.runner.run = watched_run  # type: ignore[method-assign]
    engine.start()
    try:
        done = threading.Event()
        req = GenerateRequest("r", "t", (5, 6, 7, 8), SamplingParams(max_tokens=2))
        engine.submit(req, lambda out: done.set() if out.finished else None)
        assert done.wait(120), "the request did not finish in 120 s"
    finally:
        engine.shutdown()
    assert at_forward, "no forward ran after the commit"
    return at_forward[0]


def test_what_the_inbox_shows_leaves_before_the_next_forward(checkpoint_dir) -> None:
    assert _first_token_leaves_before_the_step(checkpoint_dir, send_after_inbox=True)


def test_twin_without_the_send_after_the_inbox_the_first_token_waits_for_a_forward(
    checkpoint_dir,
) -> None:
    assert not _first_token_leaves_before_the_step(checkpoint_dir, send_after_inbox=False)
