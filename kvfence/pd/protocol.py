"""The KV transfer protocol: its messages and both sides' per-room state machines, as pure code.

`decode_step(room, event) -> (room, actions)` and `prefill_step(room, event) -> (room, actions)`
do no I/O and read no clock. The runtime (pd/decode.py, pd/prefill.py) feeds them events and
executes the actions; the model checker (formal/) explores the very same functions, so the
proof cannot drift from the code.

Ordering assumption: messages of one prefill->decode connection arrive in order and a page write
is applied before any later message of that connection is handled (tcp: one ordered stream;
mooncake: prefill sends a control message only after its writes completed). Hence a DONE or an
ABORT/ABORT_ACK from prefill means no write of that room can land afterwards: the fence for I4.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

# The one Guards type of kvfence, re-exported: the model checker and the services read it here.
from kvfence.guards import ALL_ON as ALL_ON
from kvfence.guards import Guards as Guards

# ---- messages --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reserve:
    """decode -> prefill: pages are pre-allocated for the prompt beyond the first
    `cached_tokens` (page-aligned) tokens, whose KV decode already holds in its prefix cache;
    compute the prompt and send the pages decode lacks (dst_pages: prompt pages
    cached_tokens / page_size onwards). prefix_digest: `prefix_digest` over what decode's
    cached pages hold (namespace and tokens of each), which prefill recomputes from this
    RESERVE's own tenant, salt and prompt: a disagreement aborts the room before any compute."""

    room: str
    tenant: str
    prompt: tuple[int, ...]
    sampling: dict
    max_tokens: int
    dst_pages: tuple[int, ...]
    grant: int
    cache_salt: str = ""  # the request's cache_salt ("" for none): prefill's namespace too
    cached_tokens: int = 0
    prefix_digest: str = ""
    # The LoRA adapter decode resolved for the client ("" both: the base model): prefill computes
    # with the adapter of this content digest or not at all; the name is for its logs.
    lora_name: str = ""
    lora_digest: str = ""


@dataclass(frozen=True)
class Done:
    """prefill -> decode: the prompt's n_tokens / n_pages (the whole prompt), the prefix it did
    not send (cached_tokens, decode's as RESERVE said) and the digest of the pages it sent
    (indices counted from the first page sent); decode's read-back covers every page."""

    room: str
    n_tokens: int
    n_pages: int
    digest: int
    first_token: int
    # The first token's logprob entry when the client asked for logprobs (prefill sampled it).
    first_logprobs: dict = field(default_factory=dict, compare=False)
    cached_tokens: int = 0
    lora_digest: str = ""  # the adapter prefill computed the KV with ("": the base model)


@dataclass(frozen=True)
class DoneAck:
    room: str


@dataclass(frozen=True)
class Abort:
    room: str
    code: str
    message: str
    status: int  # the HTTP status the client should see


@dataclass(frozen=True)
class AbortAck:
    room: str


Message = Reserve | Done | DoneAck | Abort | AbortAck

# ---- actions ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    message: Message


@dataclass(frozen=True)
class FailClient:
    """Tell the client the request failed (decode) with this reason; pages are NOT freed."""

    code: str
    message: str
    status: int


@dataclass(frozen=True)
class Commit:
    """Decode: the KV is complete and verified; start decoding after first_token."""

    first_token: int
    first_logprobs: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class ReleasePages:
    """No writer (decode) or reader (prefill) of the room's pages remains: free them (I4)."""


@dataclass(frozen=True)
class StartCompute:
    """Prefill: the room passed admission; run its prompt."""


@dataclass(frozen=True)
class CancelCompute:
    """Prefill: stop computing the room; the engine frees the pages it alone wrote."""


@dataclass(frozen=True)
class SendPages:
    """Prefill: stream the room's pages, then feed SendComplete."""


@dataclass(frozen=True)
class StopSending:
    """Prefill: send no further page of the room."""


Action = (
    Send
    | FailClient
    | Commit
    | ReleasePages
    | StartCompute
    | CancelCompute
    | SendPages
    | StopSending
)

# ---- decode side -----------------------------------------------------------------------------


class DState(enum.Enum):
    RESERVED = "reserved"  # pages held, RESERVE sent, prefill may write them
    ABORTING = "aborting"  # client told of failure; prefill may still write: wait for its fence
    COMMITTED = "committed"  # KV verified, decoding; the transfer is over
    RELEASED = "released"  # pages returned (or handed to decoding); nothing more to do


@dataclass(frozen=True)
class DecodeRoom:
    room: str
    n_tokens: int
    n_pages: int  # the whole prompt's pages
    state: DState = DState.RESERVED
    cached_pages: int = 0  # leading pages decode holds from its prefix cache: never sent
    cached_tokens: int = 0  # their tokens (cached_pages * page size)
    received: frozenset[int] = frozenset()
    checksums: tuple[tuple[int, int], ...] = ()  # (index, checksum) as declared by prefill
    bad_page: bool = False  # a page failed its checksum or grant check on arrival
    lora_digest: str = ""  # the adapter decode will decode with, as its RESERVE named it


@dataclass(frozen=True)
class PageArrived:
    index: int
    n_tokens: int
    checksum: int
    intact: bool  # the receiver's checksum of the bytes equals `checksum` and the grant matched


@dataclass(frozen=True)
class RunArrived:
    """A run of pages handled together (one PageRun frame): the same as its pages' PageArrived
    events one after another, in one transition (a room's pages cost O(pages), not O(pages^2))."""

    pages: tuple[PageArrived, ...]


@dataclass(frozen=True)
class DoneArrived:
    done: Done
    # Read-back of every page decode will attend to: the sent ones hash to done.digest and the
    # cached ones still hold what they held when RESERVE went out.
    pool_digest_ok: bool


@dataclass(frozen=True)
class AbortArrived:
    abort: Abort


@dataclass(frozen=True)
class AbortAckArrived:
    pass


@dataclass(frozen=True)
class ClientAborted:
    pass


@dataclass(frozen=True)
class TimedOut:
    pass


@dataclass(frozen=True)
class ConnectionLost:
    """The connection to the peer is closed and its reader stopped: it can deliver nothing more."""


DecodeEvent = (
    PageArrived
    | RunArrived
    | DoneArrived
    | AbortArrived
    | AbortAckArrived
    | ClientAborted
    | TimedOut
    | ConnectionLost
)

# The guards the state machines read; the others of kvfence.guards.Guards apply elsewhere.
GUARDS = frozenset({"count_check", "checksum", "deferred_release", "abort_ack"})


def digest_of(checksums: tuple[tuple[int, int], ...], n_tokens: int) -> int:
    """The transfer digest: a deterministic fold of (index, checksum) pairs and the token count.
    Pure integer arithmetic so the model checker and both sides compute it identically."""
    acc = (n_tokens * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    for index, checksum in sorted(checksums):
        acc = ((acc ^ (index * 0xBF58476D1CE4E5B9 + checksum)) * 0x94D049BB133111EB) & (2**64 - 1)
    return acc


def decode_step(
    room: DecodeRoom, event: DecodeEvent, guards: Guards = ALL_ON
) -> tuple[DecodeRoom, tuple[Action, ...]]:
    s = room.state
    if s is DState.RELEASED or s is DState.COMMITTED:
        # Late messages after the end: acknowledge aborts so the peer can finish; else ignore.
        if isinstance(event, AbortArrived):
            return room, (Send(AbortAck(room.room)),)
        return room, ()
    if isinstance(event, PageArrived | RunArrived):
        if s is not DState.RESERVED:
            return room, ()
        pages = event.pages if isinstance(event, RunArrived) else (event,)
        return replace(
            room,
            received=room.received.union(e.index for e in pages),
            checksums=(*room.checksums, *((e.index, e.checksum) for e in pages)),
            bad_page=room.bad_page or not all(e.intact for e in pages),
        ), ()
    if isinstance(event, DoneArrived):
        if s is DState.ABORTING:
            # DONE fences the room: prefill writes nothing after it.
            return replace(room, state=DState.RELEASED), (Send(DoneAck(room.room)), ReleasePages())
        problem = _verify(room, event, guards)
        if problem is None:
            return replace(room, state=DState.COMMITTED), (
                Send(DoneAck(room.room)),
                Commit(event.done.first_token, event.done.first_logprobs),
            )
        return replace(room, state=DState.RELEASED), (
            Send(DoneAck(room.room)),
            FailClient("kv_transfer_incomplete", problem, 500),
            ReleasePages(),
        )
    if isinstance(event, AbortArrived):
        a = event.abort
        actions: list[Action] = [Send(AbortAck(room.room))]
        if s is DState.RESERVED:
            actions.append(FailClient(a.code, a.message, a.status))
        # An ABORT from prefill is sent after its last write of the room: it is a fence too.
        actions.append(ReleasePages())
        return replace(room, state=DState.RELEASED), tuple(actions)
    if isinstance(event, AbortAckArrived):
        if s is DState.ABORTING:
            return replace(room, state=DState.RELEASED), (ReleasePages(),)
        return room, ()
    if isinstance(event, ClientAborted | TimedOut):
        if s is not DState.RESERVED:
            return room, ()
        fail = (
            FailClient("request_aborted", "the client went away", 499)
            if isinstance(event, ClientAborted)
            else FailClient("kv_transfer_timeout", "the KV transfer timed out", 504)
        )
        if not guards.on("deferred_release"):
            # Mutation twin: free at once although prefill may still write (the peer's bug).
            return replace(room, state=DState.RELEASED), (
                fail,
                Send(Abort(room.room, fail.code, fail.message, fail.status)),
                ReleasePages(),
            )
        return replace(room, state=DState.ABORTING), (
            fail,
            Send(Abort(room.room, fail.code, fail.message, fail.status)),
        )
    if isinstance(event, ConnectionLost):
        actions = []
        if s is DState.RESERVED:
            actions.append(FailClient("prefill_unavailable", "lost the prefill worker", 503))
        actions.append(ReleasePages())
        return replace(room, state=DState.RELEASED), tuple(actions)
    raise TypeError(f"unknown decode event {event!r}")


def _verify(room: DecodeRoom, event: DoneArrived, guards: Guards) -> str | None:
    """I3: the reason to refuse the commit, or None when everything matches."""
    d = event.done
    if guards.on("count_check"):
        if d.n_tokens != room.n_tokens:
            return f"prefill computed {d.n_tokens} tokens, decode reserved {room.n_tokens}"
        if d.cached_tokens != room.cached_tokens:
            return (
                f"prefill skipped {d.cached_tokens} cached tokens, decode holds "
                f"{room.cached_tokens}"
            )
        sent = room.n_pages - room.cached_pages
        if d.n_pages != room.n_pages or len(room.received) != sent:
            return (
                f"decode reserved {sent} of {room.n_pages} pages, prefill reported "
                f"{d.n_pages}, {len(room.received)} arrived"
            )
    if guards.on("lora_pd_digest") and d.lora_digest != room.lora_digest:
        return (
            f"prefill computed the KV with adapter {d.lora_digest or 'none'}, decode holds "
            f"{room.lora_digest or 'none'}"
        )
    if guards.on("checksum"):
        if room.bad_page:
            return "a page failed its checksum or grant check"
        if digest_of(room.checksums, d.n_tokens) != d.digest or not event.pool_digest_ok:
            return "the transfer digest does not match the pages in the pool"
    return None


# ---- prefill side ----------------------------------------------------------------------------


class PState(enum.Enum):
    COMPUTING = "computing"  # admitted; the engine is running the prompt
    SENDING = "sending"  # pages are being written to decode
    AWAIT_ACK = "await_ack"  # DONE sent; source pages kept until DONE_ACK
    CLOSED = "closed"  # nothing held


@dataclass(frozen=True)
class PrefillRoom:
    room: str
    state: PState


@dataclass(frozen=True)
class ReserveArrived:
    """The runtime ran admission (the third door) on the RESERVE before feeding this event."""

    admitted: bool
    code: str = ""
    message: str = ""
    status: int = 400


@dataclass(frozen=True)
class Prefilled:
    pass


@dataclass(frozen=True)
class SendComplete:
    done: Done


@dataclass(frozen=True)
class ComputeFailed:
    code: str
    message: str


@dataclass(frozen=True)
class DoneAckArrived:
    pass


PrefillEvent = (
    ReserveArrived
    | Prefilled
    | SendComplete
    | ComputeFailed
    | DoneAckArrived
    | AbortArrived
    | TimedOut
    | ConnectionLost
)


def prefill_open(room: str, event: ReserveArrived) -> tuple[PrefillRoom, tuple[Action, ...]]:
    """A RESERVE for a new room. A rejected one holds nothing and answers ABORT at once (I1)."""
    if not event.admitted:
        return PrefillRoom(room, PState.CLOSED), (
            Send(Abort(room, event.code, event.message, event.status)),
        )
    return PrefillRoom(room, PState.COMPUTING), (StartCompute(),)


def prefill_step(
    room: PrefillRoom, event: PrefillEvent, guards: Guards = ALL_ON
) -> tuple[PrefillRoom, tuple[Action, ...]]:
    s = room.state
    closed = replace(room, state=PState.CLOSED)
    if isinstance(event, AbortArrived):
        ack: tuple[Action, ...] = (Send(AbortAck(room.room)),) if guards.on("abort_ack") else ()
        if s is PState.COMPUTING:
            return closed, (CancelCompute(), *ack)
        if s is PState.SENDING:
            # StopSending first: the ack leaves after the last page on the ordered stream.
            return closed, (StopSending(), *ack, ReleasePages())
        if s is PState.AWAIT_ACK:
            return closed, (*ack, ReleasePages())
        return room, ack  # CLOSED: aborts are idempotent and always acknowledged
    if s is PState.CLOSED:
        return room, ()
    if isinstance(event, Prefilled) and s is PState.COMPUTING:
        return replace(room, state=PState.SENDING), (SendPages(),)
    if isinstance(event, SendComplete) and s is PState.SENDING:
        return replace(room, state=PState.AWAIT_ACK), (Send(event.done),)
    if isinstance(event, DoneAckArrived) and s is PState.AWAIT_ACK:
        return closed, (ReleasePages(),)
    if isinstance(event, ComputeFailed) and s is PState.COMPUTING:
        return closed, (Send(Abort(room.room, event.code, event.message, 500)),)
    if isinstance(event, ComputeFailed) and s is PState.SENDING:
        # The sender refused its source (e.g. I2): no page follows, so the ABORT fences decode.
        return closed, (
            StopSending(),
            Send(Abort(room.room, event.code, event.message, 500)),
            ReleasePages(),
        )
    if isinstance(event, TimedOut):
        # Any failure tells the peer (DESIGN: ABORT with the reason); the ABORT is a fence.
        abort = Send(Abort(room.room, "kv_transfer_timeout", "prefill timed out the room", 504))
        if s is PState.COMPUTING:
            return closed, (CancelCompute(), abort)
        if s is PState.SENDING:
            return closed, (StopSending(), abort, ReleasePages())
        return closed, (ReleasePages(),)  # DONE is out: decode needs nothing more
    if isinstance(event, ConnectionLost):
        if s is PState.COMPUTING:
            return closed, (CancelCompute(),)
        if s is PState.SENDING:
            return closed, (StopSending(), ReleasePages())
        return closed, (ReleasePages(),)
    return room, ()
