"""One sequence's place in its grammar, and the allowed-token bitmask of a step's rows.

The seam with the sampler: the engine builds a TokenMask for a step (one bitmask row per
constrained logits row, filled by that row's Matcher), engine/sampler.py applies it to the
logits before either sampler runs, and the engine then `accept`s the token drawn and
`prepare`s the next mask (so it is ready when the next logits come). A sequence
keeps its Matcher across preemption (preemption keeps the generated tokens, so the grammar
state is still exact on resumption). `fork` copies a state: each beam-search beam gets its own
copy of its parent's (engine/beam_driver.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xgrammar

from radixserve.native import sampling as native_sampling


class Matcher:
    """Where one sequence stands in its grammar: which tokens may come next.

    `prepare` fills the current state's mask into the matcher's own row ahead of time: the
    engine calls it right after a token is accepted, when the matcher's structures are still in
    the cache, so that between the next forward pass and its sampling the mask is ready (a
    fill there finds every cache cold). `accept` and `rollback` make it stale.
    """

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._prepared: torch.Tensor | None = None  # [1, words], allocated on first prepare
        self._prepared_words = np.empty((0, 0), dtype=np.int32)  # _prepared's memory, as numpy
        self._ready = False  # whether _prepared holds the current state's mask

    def fill(self, bitmask: torch.Tensor | np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 words, bit t of word
        t // 32 set when token t is allowed; a tensor, or a numpy array, which the library
        takes for less per call)."""
        if self._ready:
            bitmask[row] = self._prepared_words[0]  # type: ignore[index]
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def prepare(self) -> None:
        """Fills the current state's mask now into this matcher's own row (nothing once the
        grammar has terminated: no token comes next)."""
        if self._ready or self._matcher.is_terminated():
            return
        if self._prepared is None:
            self._prepared = xgrammar.allocate_token_bitmask(1, self._vocab_size)
            self._prepared_words = self._prepared.numpy()  # the same memory
        self._matcher.fill_next_token_bitmask(self._prepared_words, 0)
        self._ready = True

    def prepared_mask(self) -> torch.Tensor | None:
        """The current state's mask ([1, words], owned by this matcher: valid until it next
        advances) if it was prepared, else None."""
        return self._prepared if self._ready else None

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (state unchanged) when the grammar does not allow it."""
        accepted = bool(self._matcher.accept_token(token))
        self._ready = self._ready and not accepted
        return accepted

    def fork(self) -> Matcher:
        """An independent copy of this state (a beam's child continues from its parent)."""
        return Matcher(self._matcher.fork(), self._vocab_size)

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        self._matcher.rollback(num_tokens)
        self._ready = self._ready and num_tokens == 0

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
    def for_rows(matchers: list[tuple[int, Matcher]], vocab_size: int, buffer: MaskBuffer | None = None) -> TokenMask:
        """The mask of the rows that have a matcher, filled by their matchers; into `buffer`'s
        rows when given (valid until the buffer's next use), else into a new tensor."""
        rows = [row for row, _ in matchers]
        if len(matchers) == 1:  # the common single row: its prepared mask as it is, no copy
            prepared = matchers[0][1].prepared_mask()
            if prepared is not None:
                return TokenMask(prepared, rows)
        bitmask = (buffer.take(len(matchers), vocab_size) if buffer is not None
                   else xgrammar.allocate_token_bitmask(len(matchers), vocab_size))
        words = bitmask.numpy()  # the same memory
        for i, (_, matcher) in enumerate(matchers):
            matcher.fill(words, i)
        return TokenMask(bitmask, rows)

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


class MaskBuffer:
    """One reused bitmask tensor for a step's masks: a step's mask is built in the rows of the
    same warm memory as the last one's, instead of a fresh allocation (for 64 rows, 400 kB:
    fresh pages every step). Not thread safe; one per engine. A mask taken from it is valid
    until the next `take`."""

    def __init__(self) -> None:
        self._words = torch.empty(0, 0, dtype=torch.int32)

    def take(self, rows: int, vocab_size: int) -> torch.Tensor:
        """`rows` rows of int32 words for `vocab_size` tokens (contents unspecified: a
        matcher's fill writes every word)."""
        words = (vocab_size + 31) // 32
        if self._words.shape[0] < rows or self._words.shape[1] != words:
            self._words = torch.empty(max(rows, 2 * self._words.shape[0]), words, dtype=torch.int32)
        return self._words[:rows]
