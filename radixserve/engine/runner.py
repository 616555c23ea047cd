"""One forward pass over a batch of chunks: page indices in, logits out."""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.cache.pool import PagePool
from radixserve.engine.scheduler import ScheduledChunk
from radixserve.models.loader import LoadedModel


class ModelRunner:
    """Builds the step's metadata once and runs the model over the pool's pages.

    The seam below the scheduler: it sees token ids, block tables and lengths, never the
    tree or the queues.
    """

    def __init__(self, loaded: LoadedModel, pool: PagePool, backend: AttentionBackend) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.pool = pool
        self.backend = backend

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Runs every chunk; returns float32 logits [number of chunks needing logits, vocab]."""
        input_ids: list[int] = []
        logits_indices: list[int] = []
        for chunk in chunks:
            seq = chunk.seq
            input_ids.extend(seq.token_ids[seq.num_computed: seq.num_computed + chunk.num_new])
            if chunk.needs_logits:
                logits_indices.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            block_tables=[c.seq.block_table for c in chunks],
            kv_lens=[c.seq.num_computed + c.num_new for c in chunks],
            num_new_tokens=[c.num_new for c in chunks],
            page_size=self.pool.page_size,
            device=self.device,
        )
        self.backend.plan(meta, num_qo_heads=self.config.num_attention_heads,
                          num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
                          dtype=self.dtype)
        return self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=self.device),
            meta, self.backend, self.pool.k_cache, self.pool.v_cache,
            torch.tensor(logits_indices, dtype=torch.int64, device=self.device),
        )
