"""A filling wave's early first tokens (kvfence/engine/waves.py, FILL) as the scheduler's queues
stand: which held prompts have theirs in a step, and where a step stops so that they come as
soon as their TPOT target lets them rather than at the end of a whole chunk. Reads the
sequences; the arithmetic is waves.py's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvfence.engine.sequence import Sequence
from kvfence.engine.step_budget import StepCost
from kvfence.engine.waves import early_firsts, early_rest


@dataclass(frozen=True)
class Fill:
    """A filling wave once a step's chunks are computed."""

    held: list[Sequence]  # computed but their last prompt token, no first token yet: oldest first
    rest: int  # prompt tokens the wave has still to compute then, held last tokens aside
    size: int  # the wave's prompts
    out_tokens: int  # tokens the fewest-token stream decodes after its first (held ones first)
    early: int  # early first tokens had, the leader's aside (-1: no leader yet)
    next_held: int  # tokens until the oldest prompt still computing is held (0: none is)

    @staticmethod
    def of(
        running: Iterable[Sequence],
        waiting: Iterable[Sequence],
        firsts: list[Sequence],
        now: dict[str, int],
    ) -> Fill:
        """The fill after a step computing now[request id] tokens of each prompt."""
        running, waiting = list(running), list(waiting)
        held = [s for s in running if not s.output_ids and s.in_decode]
        left = [
            max(0, s.num_uncomputed - now.get(s.request_id, 0) - 1)
            for s in running
            if not s.output_ids and not s.in_decode
        ] + [len(s.token_ids) - 1 for s in waiting]
        size = len(waiting) + sum(not s.output_ids for s in running)
        size += sum(bool(s.output_ids) for s in firsts)  # the leader may have none yet
        wave = held or [s for s in [*running, *waiting] if not s.output_ids]
        out_tokens = min((s.admitted.max_tokens for s in wave), default=1) - 1
        next_held = next((n for n in left if n > 0), 0)
        return Fill(held, sum(left) + len(waiting), size, out_tokens, len(firsts) - 1, next_held)

    def firsts(self, cost: StepCost | None, chunk: int, target_tpot_ms: float) -> list[Sequence]:
        """The held prompts whose first tokens come in this step (waves.early_firsts)."""
        if not self.held:
            return []
        n = early_firsts(
            cost, chunk, self.rest, self.size, self.out_tokens, target_tpot_ms, max(0, self.early)
        )
        return self.held[:n]

    def stop(self, cost: StepCost | None, chunk: int, target_tpot_ms: float, budget: int) -> int:
        """The step's prompt tokens (at most `budget`; this fill seen before any chunk). While
        early first tokens may still come, a step stops where they may start to
        (waves.early_rest), and from there where the next prompt is computed but its held token,
        so that each comes as soon as its target lets it: with whole chunks they came at the end
        of the chunk that passed that point, and those of prompts computed later one chunk
        apart."""
        if self.early < 0:
            return budget  # the leader's step: the wave's prompts may still be arriving
        last = early_rest(
            cost, chunk, self.rest, self.size, self.out_tokens, target_tpot_ms, self.early
        )
        if last < 0:
            return budget
        if self.rest > last:
            return min(budget, self.rest - last)
        return min(budget, self.next_held) if self.next_held else budget
