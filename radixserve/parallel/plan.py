"""The step plan rank 0 sends every rank: what changed since the last step, never the state.

A plan is one int32 array (`StepPlan.encode`):

    header  [kind, sequences, tokens, logits rows, KV-op ints, forgotten, table ints]
    per sequence  [seq id, KV length, new tokens, pages out of window, kept entries, tail length]
    table tails   the block-table entries after the kept ones, sequence after sequence
    tokens        the step's new token ids (all sequences, in order)
    logits rows   which rows of the flat batch need logits (the sampling's needs)
    KV ops        [op, a, b, c] per page copy since the last plan (copy-on-write, host tier)
    forgotten     seq ids whose block tables the ranks may drop

Block tables travel as changes: every rank keeps a replica of each live sequence's table
(`TableReplica`); rank 0's `PlanBuilder` remembers what the replicas hold and sends, per
sequence, how many leading entries stay and the entries after them. A decoding sequence
sends a page id only when it starts a page, so a plan's size depends on the batch, not on
the context length. Rank 0 runs its own replica from the same plans, so every rank builds
its step from identical inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.engine.scheduler import ScheduledChunk

STEP, CHECK, SETUP, STOP = 1, 2, 3, 4  # plan kinds
COPY_PAGE, OFFLOAD, LOAD = 1, 2, 3  # KV ops: [op, a, b, c]
_HEADER = 7
_PER_SEQUENCE = 6
STALE_TABLES = 64  # replicas of absent sequences kept beyond the batch size


@dataclass
class StepPlan:
    """One message from rank 0 (see the module docstring for the layout)."""

    kind: int = STEP
    sequences: np.ndarray = field(default_factory=lambda: np.zeros((0, _PER_SEQUENCE), np.int32))
    tails: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    input_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logits_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    kv_ops: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int32))
    forgotten: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def encode(self) -> np.ndarray:
        """The plan as one int32 array."""
        header = np.array([self.kind, len(self.sequences), len(self.input_ids), len(self.logits_indices),
                           self.kv_ops.size, len(self.forgotten), len(self.tails)], dtype=np.int32)
        parts = (header, self.sequences.ravel(), self.tails, self.input_ids, self.logits_indices,
                 self.kv_ops.ravel(), self.forgotten)
        return np.concatenate([np.asarray(p, dtype=np.int32) for p in parts])

    @classmethod
    def decode(cls, message: np.ndarray) -> StepPlan:
        """The plan `encode` wrote."""
        kind, num_seqs, num_tokens, num_logits, op_ints, num_forgotten, table_ints = message[:_HEADER].tolist()
        sizes = (num_seqs * _PER_SEQUENCE, table_ints, num_tokens, num_logits, op_ints, num_forgotten)
        bounds = np.cumsum((_HEADER, *sizes))
        parts = [message[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]
        return cls(kind, parts[0].reshape(num_seqs, _PER_SEQUENCE), parts[1], parts[2], parts[3],
                   parts[4].reshape(-1, 4), parts[5])


class KvOpLog:
    """Page copies rank 0 made since its last plan, in order, for the other ranks to repeat."""

    def __init__(self) -> None:
        self._ops: list[tuple[int, int, int, int]] = []

    def record(self, op: int, sources: Sequence[int], destinations: Sequence[int], slots: int = 0) -> None:
        """Copies of page sources[i] into destinations[i] (`slots`: COPY_PAGE's slot count)."""
        self._ops.extend((op, int(s), int(d), slots) for s, d in zip(sources, destinations))

    def drain(self) -> np.ndarray:
        """The ops recorded since the last drain, as [n, 4] int32; the log is emptied."""
        ops = np.array(self._ops, dtype=np.int32).reshape(-1, 4)
        self._ops.clear()
        return ops


class _SentTable:
    """What the replicas hold of one sequence's block table."""

    __slots__ = ("last_step", "pages", "source")

    def __init__(self) -> None:
        self.source: list[int] | None = None
        self.pages = np.zeros(0, dtype=np.int32)
        self.last_step = 0


class PlanBuilder:
    """Rank 0: turns a step's chunks into a StepPlan carrying only block-table changes.

    Relies on the scheduler's contract (attention/metadata.py): a block table list is only
    appended to in place; any other change assigns a new list. An appended list sends its new
    entries; a new list is compared with what the replicas hold and sends the entries from
    the first that differs.
    """

    def __init__(self, kv_log: KvOpLog, *, verify: bool = False) -> None:
        self.kv_log = kv_log
        self.verify = verify  # debug checks: what the replicas hold equals every table, every step
        self._sent: dict[int, _SentTable] = {}
        self._step = 0

    def plan(self, chunks: list[ScheduledChunk]) -> StepPlan:
        """The plan of one forward step over `chunks`."""
        self._step += 1
        rows = np.zeros((len(chunks), _PER_SEQUENCE), dtype=np.int32)
        tails: list[np.ndarray] = []
        input_ids: list[int] = []
        logits_indices: list[int] = []
        for i, chunk in enumerate(chunks):
            seq, new = chunk.seq, chunk.num_new
            start, end = seq.num_computed, seq.num_computed + new
            input_ids += seq.token_ids[start:end]
            if end == len(seq.token_ids):  # the chunk reaches the last token: it yields logits
                logits_indices.append(len(input_ids) - 1)
            keep, tail = self._table_change(seq.seq_id, seq.block_table)
            tails.append(tail)
            rows[i] = (seq.seq_id, end, new, seq.pages_out_of_window, keep, len(tail))
        return StepPlan(STEP, rows, np.concatenate(tails) if tails else np.zeros(0, np.int32),
                        np.asarray(input_ids, dtype=np.int32), np.asarray(logits_indices, dtype=np.int32),
                        self.kv_log.drain(), self._forget(len(chunks)))

    def _table_change(self, seq_id: int, table: list[int]) -> tuple[int, np.ndarray]:
        """(entries the replica keeps, entries after them) for `seq_id`'s `table`."""
        sent = self._sent.get(seq_id)
        if sent is None:
            sent = self._sent[seq_id] = _SentTable()
        sent.last_step = self._step
        held = len(sent.pages)
        if table is sent.source and len(table) >= held:
            keep = held
        else:
            current = np.asarray(table, dtype=np.int32)
            common = min(held, len(current))
            differ = np.flatnonzero(sent.pages[:common] != current[:common])
            keep = int(differ[0]) if differ.size else common
        tail = np.asarray(table[keep:], dtype=np.int32)
        sent.source = table
        sent.pages = np.concatenate([sent.pages[:keep], tail])
        if self.verify and not np.array_equal(sent.pages, np.asarray(table, dtype=np.int32)):
            raise AssertionError(f"sequence {seq_id}: its block table changed in place; "
                                 "assign a new list instead (see attention/metadata.py)")
        return keep, tail

    def _forget(self, batch_size: int) -> np.ndarray:
        """Seq ids absent from this step whose replicas are dropped (once there are many)."""
        if len(self._sent) <= batch_size + STALE_TABLES:
            return np.zeros(0, dtype=np.int32)
        stale = [s for s, sent in self._sent.items() if sent.last_step != self._step]
        for seq_id in stale:
            del self._sent[seq_id]
        return np.asarray(stale, dtype=np.int32)


class TableReplica:
    """Every rank: the block tables of live sequences, rebuilt from the plans' changes.

    Honours the same contract as the scheduler (appends in place, other changes as a new
    list), so a MetadataBuilder over these lists copies only what is new.
    """

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def apply(self, plan: StepPlan) -> list[list[int]]:
        """Applies `plan`'s table changes; returns the tables of its sequences, in order."""
        out: list[list[int]] = []
        offset = 0
        for seq_id, _, _, _, keep, tail_len in plan.sequences.tolist():
            tail = plan.tails[offset:offset + tail_len].tolist()
            offset += tail_len
            table = self.tables.get(seq_id)
            if table is not None and keep == len(table):
                table.extend(tail)
            else:
                table = self.tables[seq_id] = (table[:keep] if table is not None else []) + tail
            out.append(table)
        for seq_id in plan.forgotten.tolist():
            self.tables.pop(seq_id, None)
        return out
