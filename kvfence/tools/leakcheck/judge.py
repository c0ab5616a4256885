"""Judging one answer: the `Outcome` of a request (its reply, leaks, wrong status) and the rule
that says whether a status is right for a request of that length."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvfence.tools.canary import Leak
from kvfence.tools.leakcheck.api import Reply
from kvfence.tools.leakcheck.common import NOT_A_VERDICT
from kvfence.tools.leakcheck.wording import is_length_refusal


@dataclass
class Outcome:
    request_id: str  # ours, also sent as X-Request-Id
    prompt_id: str  # owner of the prompt's canaries (several sends may share one prompt)
    probe: str
    case: str
    tenant: str
    endpoint: str
    stream: bool
    max_tokens: int | None
    prompt_tokens: int | None  # best known: server usage > error message > tokenizer > fit
    reply: Reply
    # Where prompt_tokens came from: usage | refusal | refusal (at least) | tokenizer | fit |
    # estimate. Only "estimate" is leakcheck's own guess.
    tokens_source: str = "estimate"
    leaks: list[Leak] = field(default_factory=list)
    wrong_status: str | None = None
    echoed_own: bool = False
    unjudged: str | None = None  # why this answer could not be judged; None when it was

    @property
    def error(self) -> str | None:
        r = self.reply
        if r.cancelled and r.status is None:
            return None  # we hung up on purpose
        if r.status is None or r.status >= 500 or r.status in NOT_A_VERDICT:
            return r.error or f"HTTP {r.status}"
        if 300 <= r.status < 400:
            return r.error
        return None

    def as_dict(self) -> dict[str, Any]:
        r = self.reply
        return {
            "request_id": self.request_id,
            "prompt_id": self.prompt_id,
            "probe": self.probe,
            "case": self.case,
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "status": r.status,
            "cancelled": r.cancelled,
            "server_id": r.server_id,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_source": self.tokens_source,
            "max_tokens": self.max_tokens,
            "completion_tokens": r.completion_tokens,
            "echoed_own": self.echoed_own,
            "leaks": len(self.leaks),
            "wrong_status": self.wrong_status,
            "error": self.error,
            # A refusal's own words, so a finding about a status can be checked without a replay.
            "refusal": (
                {"status": r.status, "message": r.error, "code": r.error_code}
                if r.status is not None and 400 <= r.status < 500
                else None
            ),
            "judged": self.unjudged is None,
            "unjudged_reason": self.unjudged,
        }


def judge_status(
    reply: Reply,
    prompt_tokens: int | None,
    max_tokens: int | None,
    context: int,
    *,
    clear: bool,
    lower_bound: bool = False,
) -> str | None:
    """Why this status is wrong for a request of this length, or None.

    Legal means prompt + max_tokens <= context (at least one new token when max_tokens is left
    to the server). Over-length must be refused with a 4xx; a 2xx is tolerated only when the
    server provably computed nothing past the context (a prompt of exactly N answered with an
    empty completion, or max_tokens clamped so prompt + completion <= N). A legal request
    refused with a 4xx in words about its size means the advertised context cannot be served
    (the incident's first fault); refused for anything else (a feature the server does not
    offer) it is not judged here. `clear` says a length that is only estimated is far enough
    from N to judge; `lower_bound` that the count is "at least" (then only "over-length" can be
    concluded)."""
    if status_unjudged(reply, prompt_tokens, max_tokens, context, clear, lower_bound):
        return None
    assert reply.status is not None and prompt_tokens is not None
    legal = prompt_tokens + (max_tokens if max_tokens is not None else 1) <= context
    ok = 200 <= reply.status < 300
    if legal and 400 <= reply.status < 500 and is_length_refusal(reply.error):
        return (
            f"HTTP {reply.status} for a request within the advertised context "
            f"({prompt_tokens} + {max_tokens} <= {context}): {reply.error or ''}"[:300]
        )
    if not legal and ok:
        done = reply.completion_tokens
        if reply.cancelled and not reply.text:
            return None  # hung up before any token: nothing to hold against it
        if done is not None and prompt_tokens <= context and prompt_tokens + done <= context:
            return None
        return (
            f"HTTP {reply.status} for an over-length request ({prompt_tokens} prompt tokens, "
            f"max_tokens {max_tokens}, context {context}): it must be refused with a 4xx"
        )
    return None


def status_unjudged(
    reply: Reply,
    prompt_tokens: int | None,
    max_tokens: int | None,
    context: int,
    clear: bool,
    lower_bound: bool,
) -> str | None:
    """Why this reply's status cannot be judged against the request's length; None if it can."""
    status = reply.status
    if status is None:
        if reply.cancelled:
            return "we hung up before the status line"
        return f"no response: {reply.error or 'transport error'}"
    if status in NOT_A_VERDICT:
        return f"HTTP {status} says nothing about the length: {reply.error or ''}"[:300]
    if status >= 500:
        return f"HTTP {status}: {reply.error or ''}"[:300]
    if 300 <= status < 400:
        return f"HTTP {status}: {reply.error or ''}"[:300]
    if 200 <= status < 300 and not reply.answered and not reply.cancelled:
        return f"HTTP {status} without an answer in its body: {reply.error or ''}"[:300]
    if prompt_tokens is None:
        return "the prompt's length is unknown (no usage, no count in the refusal, no tokenizer)"
    if not clear:
        return (
            f"the prompt's length is only leakcheck's estimate ({prompt_tokens} tokens), too "
            f"close to the context ({context}) to judge"
        )
    fits = prompt_tokens + (max_tokens if max_tokens is not None else 1) <= context
    if lower_bound and fits:
        return (
            f"the server's count is a lower bound (at least {prompt_tokens} tokens), which does "
            "not say whether the request fits"
        )
    if fits and 400 <= status < 500 and not is_length_refusal(reply.error):
        # A server declining a feature (no chat template, an unsupported parameter) is right
        # to: it says nothing about whether a request of this length would be served.
        return f"HTTP {status} for a reason other than length: {reply.error or ''}"[:300]
    return None


def read_unjudged(outcome: Outcome, context: int, clear: bool, lower_bound: bool) -> str | None:
    """For a request whose answer is read for canaries: judged when an answer was read, when we
    cut it on purpose, or when its status alone could be judged (a refusal of known length)."""
    r = outcome.reply
    if r.cancelled or (r.status is not None and 200 <= r.status < 300):
        return None
    tokens, max_tokens = outcome.prompt_tokens, outcome.max_tokens
    return status_unjudged(r, tokens, max_tokens, context, clear, lower_bound)
