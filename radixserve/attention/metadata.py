"""Step metadata built incrementally: block tables mirrored as arrays across steps.

A decoding sequence's block table changes by at most one appended page per step, yet
flattening every table from Python lists each step costs time proportional to the whole
context of the batch (tens of milliseconds at 256 sequences x 16k tokens). `MetadataBuilder`
keeps, per sequence id, an int32 mirror of its block table and copies over only the pages
appended since the last step, so a step's host work is proportional to the batch size plus
the new pages; the rest is numpy over the batch (`AttentionMetadata.from_page_arrays`).

The contract with whoever owns the tables (the scheduler): a sequence's block table list is
only ever *appended to* in place; any other change (pages replaced, the table out_of_window)
assigns a new list. The mirror holds a reference to the list it copied, so a new list is
always noticed. With `verify=True` (the engine's debug checks) every mirror is compared with
its list each step, so a change in place that breaks the contract fails loudly in tests.

Sliding window. A sequence that released its leading pages (they fell out of every layer's
window) says how many (`pages_out_of_window`); their entries stay in its list as placeholders and
the metadata lists only the pages after them, with the tokens before as `kv_offsets`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixserve.attention.base import AttentionMetadata

STALE_MIRRORS = 64  # mirrors of sequences absent from a step kept beyond the batch size


class _TableMirror:
    """An int32 copy of one block table list, grown by appends (capacity doubles)."""

    __slots__ = ("source", "synced", "pages")

    def __init__(self) -> None:
        self.source: Sequence[int] | None = None
        self.synced = 0
        self.pages = np.zeros(0, dtype=np.int32)

    def sync(self, table: Sequence[int]) -> np.ndarray:
        """The mirror of `table` after copying whatever is new; returns all of its pages."""
        length = len(table)
        if table is not self.source or length < self.synced:
            self.source, self.synced = table, 0
        if length > self.synced:
            if length > len(self.pages):
                grown = np.zeros(max(2 * len(self.pages), length, 16), dtype=np.int32)
                grown[: self.synced] = self.pages[: self.synced]
                self.pages = grown
            new = table[self.synced:length]
            self.pages[self.synced:length] = np.fromiter(new, dtype=np.int32, count=length - self.synced)
            self.synced = length
        return self.pages[:length]


class MetadataBuilder:
    """Builds each step's `AttentionMetadata` from (sequence id, block table, lengths).

    Keeps an array mirror of every recently seen sequence's block table (see the module
    docstring for the contract); mirrors of sequences that stop appearing are out_of_window.
    """

    def __init__(self, page_size: int, device: str | torch.device, *, verify: bool = False) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.verify = verify
        self._mirrors: dict[int, _TableMirror] = {}
        self._step = 0
        self._last_seen: dict[int, int] = {}

    def build(self, seq_ids: Sequence[int], block_tables: Sequence[Sequence[int]],
              kv_lens: Sequence[int], num_new_tokens: Sequence[int],
              pages_out_of_window: Sequence[int] | None = None) -> AttentionMetadata:
        """The metadata of one step; arguments as in `AttentionMetadata.build`, plus a stable
        id per sequence and, per sequence, how many leading pages of its table it released
        (sliding window; default none). Raises ValueError on inconsistent inputs."""
        if not len(seq_ids) == len(block_tables) == len(kv_lens) == len(num_new_tokens):
            raise ValueError("seq_ids, block_tables, kv_lens and num_new_tokens differ in length")
        self._step += 1
        size = self.page_size
        kv = np.fromiter(kv_lens, dtype=np.int64, count=len(kv_lens))
        needed = (-(-kv // size)).tolist()
        out_of_window = [0] * len(seq_ids) if pages_out_of_window is None else list(pages_out_of_window)
        tables: list[np.ndarray] = []
        for seq_id, table, n, first in zip(seq_ids, block_tables, needed, out_of_window):
            mirror = self._mirrors.get(seq_id)
            if mirror is None:
                mirror = self._mirrors[seq_id] = _TableMirror()
            pages = mirror.sync(table)
            if len(pages) < n:
                raise ValueError(f"sequence {seq_id}: {n * size} tokens' worth of pages needed, "
                                 f"block table has {len(pages)}")
            if self.verify:
                self._verify(seq_id, pages, table, first, n)
            tables.append(pages[first:n])
            self._last_seen[seq_id] = self._step
        self._prune(len(seq_ids))
        qo = np.fromiter(num_new_tokens, dtype=np.int64, count=len(num_new_tokens))
        if not any(out_of_window):
            return AttentionMetadata.from_page_arrays(tables, kv, qo, size, self.device)
        offsets = np.asarray(out_of_window, dtype=np.int64) * size
        return AttentionMetadata.from_page_arrays(tables, kv - offsets, qo, size, self.device, offsets)

    @staticmethod
    def _verify(seq_id: int, pages: np.ndarray, table: Sequence[int], first: int, needed: int) -> None:
        """Debug checks: the mirror equals its list; the attended pages are real pages."""
        if not np.array_equal(pages, np.asarray(table, dtype=np.int32)):
            raise AssertionError(f"sequence {seq_id}: its block table changed in place; "
                                 "assign a new list instead (see attention/metadata.py)")
        if first > needed or (pages[first:needed] < 0).any():
            raise AssertionError(f"sequence {seq_id}: pages {first}..{needed - 1} are attended, but "
                                 f"its block table {pages.tolist()} has released one of them")

    def _prune(self, batch_size: int) -> None:
        """Drops mirrors of sequences absent from this step once there are many of them."""
        if len(self._mirrors) <= batch_size + STALE_MIRRORS:
            return
        for seq_id in [s for s, step in self._last_seen.items() if step != self._step]:
            del self._mirrors[seq_id]
            del self._last_seen[seq_id]

    @property
    def num_mirrors(self) -> int:
        """Block tables currently mirrored (for tests)."""
        return len(self._mirrors)
