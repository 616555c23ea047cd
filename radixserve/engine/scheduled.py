"""What the scheduler hands out each step (chunks of work) and counts (its events)."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.engine.request import SequenceState


@dataclass
class ScheduledChunk:
    """`num_new` tokens of `seq`, from `seq.num_computed` on, to run in this step."""

    seq: SequenceState
    num_new: int

    @property
    def needs_logits(self) -> bool:
        """Only a chunk that reaches the sequence's last token yields a next token."""
        return self.seq.num_computed + self.num_new == self.seq.num_tokens

    @property
    def prefills(self) -> bool:
        """Whether the sequence has more than one token left to run: a prompt's (or a preempted
        sequence's) prefill, not a decode step. Read before the step runs the chunk."""
        return self.seq.num_tokens - self.seq.num_computed > 1


@dataclass
class SchedulerCounters:
    """Cumulative scheduler events, for stats."""

    preemptions: int = 0
    fair_preemptions: int = 0  # of those, for a tenant served less (engine/fair_share.py)
    paced_preemptions: int = 0  # of those, paced rows past their own slots or in a newcomer's way
    shrunk_chunks: int = 0  # prefill chunks cut to the pages they could have, instead of preempting
    held_rows: int = 0  # decoding rows that sat a step out for another tenant's share (step_share.py)
    paced_rows: int = 0  # rows of slow grammars that sat a step out for the other rows (grammar_pace.py)
    deferred_for_sharing: int = 0
    short_lane_admitted: int = 0  # short prompts admitted ahead of a running prefill's chunk
    admitted: int = 0
    loaded_tokens: int = 0  # prompt tokens copied back from the host tier instead of recomputed
    computed_tokens: int = 0  # tokens run through the model (every chunk of every step)
    recomputed_tokens: int = 0  # of those, tokens a sequence had computed before it was preempted

    @property
    def recomputed_share(self) -> float:
        """Recomputed tokens / computed tokens (0 before anything ran)."""
        return self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0
