"""One sequence's place in its grammar, and the allowed-token bitmask of a step's rows.

The seam with the sampler: the engine builds a TokenMask for a step (one bitmask row per
constrained logits row, filled by that row's Matcher), engine/sampler.py applies it to the
logits before either sampler runs, and the engine then `accept`s the token drawn. A sequence
keeps its Matcher across preemption (preemption keeps the generated tokens, so the grammar
state is still exact on resumption). `fork` copies a state: each beam-search beam gets its own
copy of its parent's (engine/beam_driver.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar

from radixserve.native import sampling as native_sampling


class Matcher:
    """Where one sequence stands in its grammar: which tokens may come next."""

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 words, bit t of word
        t // 32 set when token t is allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (state unchanged) when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token))

    def fork(self) -> Matcher:
        """An independent copy of this state (a beam's child continues from its parent)."""
        return Matcher(self._matcher.fork())

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and a stop token was accepted."""
        return bool(self._matcher.is_terminated())


@dataclass
class TokenMask:
    """Allowed tokens of some rows of a step's logits: `bitmask[i]` is row `rows[i]`'s."""

    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], on the CPU
    rows: list[int]

    @staticmethod
    def for_rows(matchers: list[tuple[int, Matcher]], vocab_size: int) -> TokenMask:
        """The mask of the rows that have a matcher, filled by their matchers."""
        bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
        for i, (_, matcher) in enumerate(matchers):
            matcher.fill(bitmask, i)
        return TokenMask(bitmask, [row for row, _ in matchers])

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place, in the masked rows only.

        CPU float32 logits go to the C sampler's library (radixserve/native/sampling.c,
        beside the sampler it feeds), where it is built; everything else (a GPU, other dtypes,
        no C compiler) to a few torch ops on the logits' device."""
        if native_sampling.usable(logits):
            native_sampling.apply_token_mask(logits, self.rows, self.bitmask)
            return
        device = logits.device
        bits = torch.arange(32, dtype=torch.int32, device=device)
        words = self.bitmask.to(device, non_blocking=True)
        allowed = ((words[:, :, None] >> bits) & 1).bool().reshape(len(self.rows), -1)[:, : logits.shape[-1]]
        rows = torch.tensor(self.rows, dtype=torch.int64, device=device)
        with torch.inference_mode():  # the model's logits are inference tensors: written in that mode
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def select(self, row: int) -> TokenMask | None:
        """This mask for logits row `row` alone, as row 0 of a one-row batch (None if `row`
        is not masked): for sampling that row by itself."""
        if row not in self.rows:
            return None
        i = self.rows.index(row)
        return TokenMask(self.bitmask[i:i + 1], [0])
