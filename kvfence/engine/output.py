"""Turning sampled tokens into a client's stream: detokenize, stop rules, and emit increments."""

from __future__ import annotations

import time

from kvfence.engine.request import FinishReason, RequestOutput, TokenLogprob
from kvfence.engine.sequence import Sequence


def advance(seq: Sequence, tok: int, eos_token_ids: frozenset[int]) -> FinishReason | None:
    """Account for seq's newest token `tok` (already appended): update its text and return the
    finish reason if a stop rule fires (a complete structured answer is one). Sends nothing."""
    if seq.first_token_at is None:
        seq.first_token_at = time.monotonic()  # the TPOT target's pace starts here
    sp = seq.admitted.request.sampling
    reason: FinishReason | None = None
    if (tok in eos_token_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
        reason = FinishReason.STOP
        new_text = seq.detok.flush(seq.output_ids[:-1])
    else:
        new_text = seq.detok.step(seq.output_ids)
    seq.text += new_text
    if sp.stop:
        hit = find_stop(seq.text, seq.sent_text_len, new_text, sp.stop)
        if hit is not None:
            seq.text = seq.text[:hit]
            reason = FinishReason.STOP
    if reason is None and seq.matcher is not None and seq.matcher.done:
        reason = FinishReason.STOP  # only EOS could follow: spare the step that samples it
        seq.text += seq.detok.flush(seq.output_ids)
    if reason is None and seq.num_output >= seq.admitted.max_tokens:
        reason = FinishReason.LENGTH
        seq.text += seq.detok.flush(seq.output_ids)
    return reason


def sendable_upto(seq: Sequence) -> int:
    """Text that can no longer become part of a stop string."""
    hold = max((len(x) for x in seq.admitted.request.sampling.stop), default=1) - 1
    return max(seq.sent_text_len, len(seq.text) - hold)


def emit(
    seq: Sequence,
    upto: int,
    reason: FinishReason | None,
    error: str | None = None,
    code: str | None = None,
    status: int | None = None,
) -> None:
    """Send seq's unsent tokens and text up to `upto`; with a reason, this is its final output,
    sent at most once (I5)."""
    if seq.client_done:
        return
    text = seq.text[seq.sent_text_len : upto]
    seq.sent_text_len = max(seq.sent_text_len, upto)
    new_ids = seq.output_ids[seq.sent_ids :]
    seq.sent_ids = seq.num_output
    logprobs, seq.pending_logprobs = seq.pending_logprobs, []
    if not text and not new_ids and reason is None:
        return
    if reason is not None:
        seq.client_done = True
        seq.finish_reason = reason
    seq.sink(
        RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tuple(new_ids),
            new_text=text,
            finish_reason=reason,
            prompt_tokens=seq.prompt_len,
            completion_tokens=seq.num_output,
            logprobs=tuple(logprobs),
            error=error,
            error_code=code,
            error_status=status,
            cached_tokens=seq.cached_tokens,
            # With the first token (its prompt is scored by then); an error carries none.
            prompt_logprobs=(
                seq.prompt_scores.take()
                if seq.prompt_scores is not None and new_ids
                else None
            ),
        )
    )


def logprob_entry(samples, i: int, tok: int, k: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if k > 0 and samples.top_ids is not None:
        top = tuple(
            zip(samples.top_ids[i, :k].tolist(), samples.top_logprobs[i, :k].tolist(), strict=True)
        )
    return TokenLogprob(tok, float(samples.chosen_logprobs[i]), top)


def find_stop(text: str, sent: int, new_text: str, stops: tuple[str, ...]) -> int | None:
    """Earliest stop-string start in the not-yet-sent tail of text, or None."""
    window_start = max(sent, len(text) - len(new_text) - max(len(x) for x in stops))
    best: int | None = None
    for stop in stops:
        pos = text.find(stop, max(0, window_start))
        if pos != -1 and (best is None or pos < best):
            best = pos
    return best
