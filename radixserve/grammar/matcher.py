"""One sequence's place in its grammar, and the allowed-token bitmask of a step's rows.

The seam with the sampler: the engine builds a TokenMask for a step (one bitmask row per
constrained logits row, filled by that row's Matcher, packed for the C sampler as it is
built), engine/sampler.py hands it to the sampler (the C sampler masks each row as it
samples it; the torch path applies it first), and the engine then `accept`s the token drawn and
`prepare`s the next mask (so it is ready when the next logits come). A sequence
keeps its Matcher across preemption (preemption keeps the generated tokens, so the grammar
state is still exact on resumption). `fork` copies a state: each beam-search beam gets its own
copy of its parent's (engine/beam_driver.py).
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np
import torch
import xgrammar

from radixserve.native import checks
from radixserve.native import sampling as native_sampling


# A mask fill's CPU time (the engine thread's) past which a sequence's grammar is too slow to
# follow. Fills of real schemas, regexes and grammars take microseconds to a millisecond, but an
# ambiguous one (`((a|aa|aaa){0,100}){0,100}` and more a's) makes xgrammar's parser track ever
# more states: fills of 0.1 s, then seconds, one after another on the thread that steps every
# request, so that one request stalled everyone's streams, and its own abort, for minutes.
# CPU time, not wall time: a descheduled engine thread is nobody's grammar's fault.
FILL_BUDGET_S = 0.05


class GrammarFault(RuntimeError):
    """A request's own grammar cannot be followed (too slow, or no token may come next): the
    request ends alone, and its client is told why (a 400, or an error event mid-stream),
    not that the server failed."""


class GrammarTooSlow(GrammarFault):
    """A sequence's grammar took longer than FILL_BUDGET_S to say which tokens come next."""


class GrammarDeadEnd(GrammarFault):
    """A sequence's grammar allows no next token, not even an end: it can never finish
    (`root ::= "a" x`, `x ::= x` after the "a")."""


class GrammarTooFewOutputs(GrammarFault):
    """Beam search ended with fewer finished beams than the request's `n`: its grammar allows
    no more distinct outputs within its max_tokens (`guided_choice` of 2 with n=4)."""


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
        self._prepared_checked: checks.MaskWords | None = None  # _prepared, checked once for C
        self._row_ids = array("q", [0])  # the logits row of _row_mask, as C reads it
        self._row_mask: TokenMask | None = None  # _prepared for one logits row, packed for C
        self._ready = False  # whether _prepared holds the current state's mask
        self.too_slow = False  # a fill or accept took longer than FILL_BUDGET_S: no more masks (check_pace)
        self.paced = False  # its mean step work passed grammar_pace.py's bound: it shares the paced part
        self._work_s = 0.0  # CPU time of fills and accepts since the last take_work
        self.last_work_s = 0.0  # what the last take_work returned
        self.mean_work_s = 0.0  # its steps' work, each step's weighing half (grammar_pace.py's)

    def fill(self, bitmask: torch.Tensor | np.ndarray, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 words, bit t of word
        t // 32 set when token t is allowed; a tensor, or a numpy array, which the library
        takes for less per call)."""
        if self._ready:
            bitmask[row] = self._prepared_words[0]  # type: ignore[index]
        else:
            self._timed_fill(bitmask, row)

    def prepare(self) -> None:
        """Fills the current state's mask now into this matcher's own row (nothing once the
        grammar has terminated: no token comes next)."""
        if self._ready or self._matcher.is_terminated():
            return
        if self._prepared is None:
            self._prepared = xgrammar.allocate_token_bitmask(1, self._vocab_size)
            self._prepared_words = self._prepared.numpy()  # the same memory
            self._prepared_checked = checks.mask_words(self._prepared)
        self._timed_fill(self._prepared_words, 0)
        self._ready = True

    def _timed_fill(self, bitmask: torch.Tensor | np.ndarray, row: int) -> None:
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self._spent(time.thread_time() - start)
        if not bitmask[row].any() and not self._matcher.is_terminated():  # a stop token counts
            raise GrammarDeadEnd("the request's output constraint allows no next token, not even an end: "
                                 "no output can ever meet it")

    def _spent(self, seconds: float) -> None:
        self._work_s += seconds
        if seconds > FILL_BUDGET_S:
            self.too_slow = True

    def take_work(self) -> float:
        """The CPU seconds of fills and accepts since the last call (engine/grammar_pace.py
        bills them to the step that did them)."""
        self.last_work_s, self._work_s = self._work_s, 0.0
        return self.last_work_s

    def check_pace(self) -> None:
        """GrammarTooSlow once a fill of this matcher took longer than FILL_BUDGET_S: the
        sampler then ends its request alone (engine/token_output.py) instead of letting the
        next, slower fills hold every other request's step."""
        if self.too_slow:
            raise GrammarTooSlow(f"the request's output constraint took over {FILL_BUDGET_S * 1000:g} ms of CPU "
                                 "to compute one step's allowed tokens (an ambiguous grammar or regex)")

    def prepared_words(self) -> checks.MaskWords | None:
        """The current state's mask if it was prepared, else None: its memory ([1, words],
        owned by this matcher, valid until it next advances; the tensor is `owner`), checked
        for C once, when allocated."""
        return self._prepared_checked if self._ready else None

    def prepared_mask(self, row: int) -> TokenMask | None:
        """The prepared mask (`prepared_words`) as the mask of logits row `row` alone, packed
        for C, or None when not prepared. The same object step after step while the row stays
        the same (its words are refilled in place), so a single constrained row builds nothing."""
        checked = self.prepared_words()
        if checked is None:
            return None
        mask = self._row_mask
        if mask is None or mask.rows[0] != row or mask.bitmask is not checked.owner:
            self._row_ids[0] = row
            mask = self._row_mask = TokenMask(checked.owner, [row], checks.NativeMask(
                checked, self._row_ids, self._row_ids.buffer_info()[0], 1, row, row))
        return mask

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (state unchanged) when the grammar does not allow it.
        Timed like a fill: an ambiguous grammar's accepts slow down with its fills (about half
        a fill each), and count against the same budget (check_pace)."""
        start = time.thread_time()
        accepted = bool(self._matcher.accept_token(token))
        self._spent(time.thread_time() - start)
        self._ready = self._ready and not accepted
        return accepted

    def fork(self) -> Matcher:
        """An independent copy of this state (a beam's child continues from its parent; paced
        if the parent is)."""
        child = Matcher(self._matcher.fork(), self._vocab_size)
        child.paced = self.paced
        return child

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
    """Allowed tokens of some rows of a step's logits: `bitmask[i]` is row `rows[i]`'s.

    `native` is the same mask as the C sampler reads it: packed (and checked) when the mask is
    built from a reused buffer (`for_rows`), else on first use (`native_mask`)."""

    bitmask: torch.Tensor  # int32 [len(rows), ceil(vocab / 32)], on the CPU
    rows: list[int]
    native: checks.NativeMask | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def for_rows(matchers: list[tuple[int, Matcher]], vocab_size: int, buffer: MaskBuffer | None = None) -> TokenMask:
        """The mask of the rows that have a matcher, filled by their matchers; into `buffer`'s
        rows when given (valid until the buffer's next use), else into a new tensor."""
        for _, matcher in matchers:
            matcher.check_pace()
        rows = [row for row, _ in matchers]
        if len(rows) == 1:  # the common single row: its prepared mask as it is, no copy
            prepared = matchers[0][1].prepared_mask(rows[0])
            if prepared is not None:
                return prepared
        if buffer is None:
            bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab_size)
            words = bitmask.numpy()  # the same memory
            for i, (_, matcher) in enumerate(matchers):
                matcher.fill(words, i)
            return TokenMask(bitmask, rows)
        bitmask, words, checked = buffer.take(len(rows), vocab_size)
        for i, (_, matcher) in enumerate(matchers):
            matcher.fill(words, i)
        row_ids, address = buffer.row_slots(rows)
        return TokenMask(bitmask, rows, checks.NativeMask(checked, row_ids, address, len(rows), min(rows), max(rows)))

    def native_mask(self) -> checks.NativeMask:
        """This mask as the C sampler reads it (`checks.native_mask` packs and checks it, once,
        unless it was built packed)."""
        if self.native is None:
            self.native = checks.native_mask(self.bitmask, self.rows)
        return self.native

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place, in the masked rows only.

        CPU float32 logits go to the C sampler's library (radixserve/native/sampling.c,
        beside the sampler it feeds), where it is built; everything else (a GPU, other dtypes,
        no C compiler) to a few torch ops on the logits' device."""
        if native_sampling.apply_native_mask(logits, self.native_mask()):
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
    """Reused memory for a step's masks: the bitmask rows and the list of their logits rows as
    the C sampler reads them, checked for C once when (re)allocated. A step's mask is built in
    the rows of the same warm memory as the last one's, instead of a fresh allocation (for 64
    rows, 400 kB: fresh pages every step). Not thread safe; one per engine. A mask taken from
    it is valid until the next `take` or `row_slots`."""

    def __init__(self) -> None:
        self._words = torch.empty(0, 0, dtype=torch.int32)
        self._numpy = self._words.numpy()  # the same memory
        self._checked = checks.mask_words(self._words)
        self._row_ids = array("q")
        self._row_ids_address = 0

    def take(self, rows: int, vocab_size: int) -> tuple[torch.Tensor, np.ndarray, checks.MaskWords]:
        """`rows` rows of int32 words for `vocab_size` tokens (contents unspecified: a
        matcher's fill writes every word), as a tensor and as numpy (the same memory), and the
        whole buffer as checked for C."""
        words = (vocab_size + 31) // 32
        if self._words.shape[0] < rows or self._words.shape[1] != words:
            self._words = torch.empty(max(rows, 2 * self._words.shape[0]), words, dtype=torch.int32)
            self._numpy = self._words.numpy()
            self._checked = checks.mask_words(self._words)
        return self._words[:rows], self._numpy[:rows], self._checked

    def row_slots(self, rows: list[int]) -> tuple[array, int]:
        """`rows` written into the buffer's int64 row list (its first len(rows) entries), and
        the list's address."""
        if len(self._row_ids) < len(rows):
            self._row_ids = array("q", bytes(8 * max(len(rows), 2 * len(self._row_ids), 8)))
            self._row_ids_address = self._row_ids.buffer_info()[0]
        row_ids = self._row_ids
        for i, row in enumerate(rows):
            row_ids[i] = row
        return row_ids, self._row_ids_address
