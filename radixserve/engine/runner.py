"""One forward pass over a batch of chunks: page indices in, logits out."""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.metadata import MetadataBuilder
from radixserve.cache.pool import PagePool
from radixserve.engine.scheduler import ScheduledChunk
from radixserve.models.loader import LoadedModel


class ModelRunner:
    """Builds the step's metadata once and runs the model over the pool's pages.

    The seam below the scheduler: it sees token ids, block tables and lengths, never the
    tree or the queues. Block tables are mirrored as arrays between steps (keyed by
    `SequenceState.seq_id`, see `attention/metadata.py`), so preparing a step costs time in the
    batch size and the new pages, not the whole context. `verify_tables` (the engine's debug
    checks) compares each mirror with its list every step.
    """

    def __init__(self, loaded: LoadedModel, pool: PagePool, backend: AttentionBackend, *,
                 verify_tables: bool = False) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pool = pool
        self.backend = backend
        self.metadata = MetadataBuilder(pool.page_size, loaded.device, verify=verify_tables)

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        """The step's metadata (backend planned), input ids and logits rows: all the host
        work before the forward pass."""
        # One pass over the chunks (this runs for every sequence on every step).
        input_ids: list[int] = []
        logits_indices: list[int] = []
        seq_ids, tables, kv_lens, num_new, out_of_window = [], [], [], [], []
        for chunk in chunks:
            seq, new = chunk.seq, chunk.num_new
            start, end = seq.num_computed, seq.num_computed + new
            tokens = seq.token_ids
            if new == 1:
                input_ids.append(tokens[start])
            else:
                input_ids += tokens[start:end]
            if end == len(tokens):  # the chunk reaches the last token: it yields logits
                logits_indices.append(len(input_ids) - 1)
            seq_ids.append(seq.seq_id)
            tables.append(seq.block_table)
            kv_lens.append(end)
            num_new.append(new)
            out_of_window.append(seq.pages_out_of_window)
        meta = self.metadata.build(seq_ids, tables, kv_lens, num_new, out_of_window)
        self.model.plan_attention(self.backend, meta, self.dtype)
        return (meta, torch.tensor(input_ids, dtype=torch.int64, device=self.device),
                torch.tensor(logits_indices, dtype=torch.int64, device=self.device))

    @torch.inference_mode()
    def forward(self, meta: AttentionMetadata, input_ids: torch.Tensor,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """The model over a prepared step; float32 logits [len(logits_indices), vocab]."""
        return self.model(input_ids, meta, self.backend, self.pool.k_cache, self.pool.v_cache,
                          logits_indices)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs every chunk; returns float32 logits [number of chunks needing logits, vocab]."""
        return self.forward(*self.prepare(chunks))
