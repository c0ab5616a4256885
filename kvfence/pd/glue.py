"""The glue between the protocol's pure state machines and their effects: which effect each
action has, what an event for a room a side no longer holds does, and when a room has ended.

pd/decode.py and pd/prefill.py drive these functions with effects on the engine and the
connection; the model checker (formal/model.py) drives the very same functions with effects on
its explicit world, so the checked glue is the running glue. What an effect does is each
caller's: the runtime's engine and sockets, the model's pools and channels.
"""

from __future__ import annotations

from typing import Protocol

from kvfence.pd import protocol as p


class DecodeEffects(Protocol):
    def send(self, message: p.Message) -> None:
        """To the room's prefill, in order with everything else sent on the connection."""

    def commit(self, first_token: int, first_logprobs: dict) -> None:
        """The transfer is verified: decoding starts after first_token."""

    def fail_client(self, code: str, message: str, status: int) -> None:
        """The client hears the error now; the pages stay held until release()."""

    def release(self) -> None:
        """No writer of the room's pages remains: return them (I4)."""


class PrefillEffects(Protocol):
    def send(self, message: p.Message, fenced: bool) -> None:
        """To the room's decode; fenced: only after every write of the room already under way
        has completed (an ABORT_ACK or DONE must never overtake a write it claims is over)."""

    def cancel_compute(self) -> None:
        """Stop computing the room; the engine frees the pages it alone wrote."""

    def release(self) -> None:
        """No reader of the room's pages remains once its writes end: return them (I4)."""

    def stop_sending(self) -> None:
        """Send no further page of the room."""

    def send_pages(self) -> None:
        """Start streaming the room's pages; the sender feeds SendComplete when done."""


def decode_ended(room: p.DecodeRoom) -> bool:
    """A room decode forgets: its pages went back to the pool or to the running sequence."""
    return room.state in (p.DState.RELEASED, p.DState.COMMITTED)


def decode_feed(
    rid: str, room: p.DecodeRoom | None, event: object, guards: p.Guards, fx: DecodeEffects
) -> p.DecodeRoom | None:
    """Feed event to decode's room rid (None, or ended: a room decode no longer holds) and run
    the effects of what the state machine decided; the room as it is now."""
    if room is None or decode_ended(room):
        if isinstance(event, p.AbortArrived):
            fx.send(p.AbortAck(rid))  # idempotent: an abort of a forgotten room is acknowledged
        return room
    room, actions = p.decode_step(room, event, guards)  # type: ignore[arg-type]
    for a in actions:
        if isinstance(a, p.Send):
            fx.send(a.message)
        elif isinstance(a, p.Commit):
            fx.commit(a.first_token, a.first_logprobs)
        elif isinstance(a, p.FailClient):
            fx.fail_client(a.code, a.message, a.status)
        elif isinstance(a, p.ReleasePages):
            fx.release()
        else:  # pragma: no cover - decode_step emits nothing else
            raise AssertionError(f"decode cannot execute {a!r}")
    return room


def prefill_start(
    rid: str, event: p.ReserveArrived, fx: PrefillEffects
) -> p.PrefillRoom:
    """Open prefill's room for a RESERVE (admitted or not) and run the effects."""
    room, actions = p.prefill_open(rid, event)
    _prefill_actions(actions, fx, fenced=room.state is not p.PState.CLOSED)
    return room


def prefill_feed(
    rid: str, room: p.PrefillRoom | None, event: object, guards: p.Guards, fx: PrefillEffects
) -> p.PrefillRoom | None:
    """Feed event to prefill's room rid (None, or closed: a room prefill no longer holds) and
    run the effects of what the state machine decided; the room as it is now."""
    if room is None or room.state is p.PState.CLOSED:
        if isinstance(event, p.AbortArrived):
            # Idempotent: an abort of a room prefill no longer holds is still acknowledged; no
            # write of it can be under way, so nothing to fence.
            fx.send(p.AbortAck(rid), fenced=False)
        return room
    room, actions = p.prefill_step(room, event, guards)  # type: ignore[arg-type]
    _prefill_actions(actions, fx, fenced=True)
    return room


def _prefill_actions(actions: tuple[p.Action, ...], fx: PrefillEffects, fenced: bool) -> None:
    for a in actions:
        if isinstance(a, p.Send):
            fx.send(a.message, fenced)
        elif isinstance(a, p.StartCompute):
            pass  # admission already queued the compute (Engine.submit)
        elif isinstance(a, p.CancelCompute):
            fx.cancel_compute()
        elif isinstance(a, p.ReleasePages):
            fx.release()
        elif isinstance(a, p.StopSending):
            fx.stop_sending()
        elif isinstance(a, p.SendPages):
            fx.send_pages()
        else:  # pragma: no cover - prefill_step emits nothing else
            raise AssertionError(f"prefill cannot execute {a!r}")
