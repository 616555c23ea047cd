"""The Llama-family model split over a tensor-parallel group (one rank's shard).

`TensorParallelLM` is `CausalLM` with its layers swapped for sharded ones (parallel/layers.py):
q/k/v and gate/up column-parallel, o and down row-parallel (one all-reduce each per layer),
the embedding and the LM head split over the vocabulary. Each rank attends with its own
query heads and their KV heads, so its KV pool holds only those heads; with fewer KV heads
than ranks, each KV head is replicated on the ranks whose query heads use it. Norms, RoPE
and the row-parallel biases are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn
from transformers import PretrainedConfig

from radixserve.models.layers import GatedMLP, linear
from radixserve.models.llama import Attention, CausalLM
from radixserve.parallel.group import TensorParallelGroup
from radixserve.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    even_split,
    vocab_rows,
)


@dataclass(frozen=True)
class HeadLayout:
    """Which query and KV heads one rank holds, as row slices of q_proj and k/v_proj."""

    num_qo_heads: int
    num_kv_heads: int
    q_rows: ShardSpec
    kv_rows: ShardSpec

    @classmethod
    def of(cls, num_qo_heads: int, num_kv_heads: int, head_dim: int, world_size: int, rank: int) -> HeadLayout:
        """Rank `rank`'s heads; ValueError when the heads cannot be split over `world_size`."""
        if num_qo_heads % world_size:
            raise ValueError(f"num_attention_heads: {num_qo_heads} is not divisible by tensor_parallel_size {world_size}")
        q_rows = even_split(num_qo_heads * head_dim, world_size, rank, "num_attention_heads * head_dim")
        if num_kv_heads >= world_size:
            if num_kv_heads % world_size:
                raise ValueError(f"num_key_value_heads: {num_kv_heads} is not divisible by "
                                 f"tensor_parallel_size {world_size}")
            kv_rows = even_split(num_kv_heads * head_dim, world_size, rank, "num_key_value_heads * head_dim")
            local_kv = num_kv_heads // world_size
        else:  # replicated: the ranks of one KV head's query group share it
            if world_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size {world_size} is not a multiple of "
                                 f"num_key_value_heads {num_kv_heads}")
            head = rank // (world_size // num_kv_heads)
            kv_rows = ShardSpec(0, head * head_dim, (head + 1) * head_dim, head_dim)
            local_kv = 1
        return cls(num_qo_heads // world_size, local_kv, q_rows, kv_rows)


def check_layout(num_qo_heads: int, num_kv_heads: int, intermediate_size: int, world_size: int) -> None:
    """ValueError, naming what does not divide, unless the heads and the MLP columns split
    over `world_size` ranks (as every rank's TensorParallelLM will split them)."""
    HeadLayout.of(num_qo_heads, num_kv_heads, 1, world_size, 0)
    even_split(intermediate_size, world_size, 0, "intermediate_size")


class TensorParallelLM(CausalLM):
    """One rank's shard of a Llama / Mistral / Qwen2 / Qwen3 model (see module docstring).

    Same forward contract as CausalLM, with the rank's head counts in `num_qo_heads` /
    `num_kv_heads` (so its KV pool is its shard); every rank must run each forward
    together. Logits come back whole on rank 0 (the vocabulary shards gathered); the other
    ranks get their own shard. `vocab_size` stays the whole vocabulary.
    """

    def __init__(self, config: PretrainedConfig, group: TensorParallelGroup) -> None:
        super().__init__(config)
        self.group = group
        size, rank = group.world_size, group.rank
        layout = HeadLayout.of(self.num_qo_heads, self.num_kv_heads, self.head_dim, size, rank)
        hidden = config.hidden_size
        mlp_rows = even_split(config.intermediate_size, size, rank, "intermediate_size")
        for layer in self.model.layers:
            _shard_attention(layer.self_attn, layout, hidden, group)
            _shard_mlp(layer.mlp, mlp_rows, hidden, group)
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden, group)
        if self.lm_head is not None:
            self.lm_head = ColumnParallelLinear(hidden, vocab_rows(config.vocab_size, size, rank), bias=False)
        self.num_qo_heads = layout.num_qo_heads
        self.num_kv_heads = layout.num_kv_heads

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """This rank's vocabulary shard of the logits, gathered whole onto rank 0."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.group.gather_last_dim(linear(hidden, weight).float())
        return logits[:, : self.vocab_size] if self.group.is_driver else logits

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Checkpoint tensor name -> the slice this rank reads (absent: read whole)."""
        specs: dict[str, ShardSpec] = {}
        for prefix, module in self.named_modules():
            if hasattr(module, "shard_specs") and module is not self:
                specs.update({f"{prefix}.{name}": spec for name, spec in module.shard_specs().items()})
        if self.lm_head is None:  # tied: a checkpoint's lm_head.weight is skipped by the loader
            specs["lm_head.weight"] = specs["model.embed_tokens.weight"]
        return specs


def _shard_attention(attn: Attention, layout: HeadLayout, hidden: int, group: TensorParallelGroup) -> None:
    qkv_bias = attn.q_proj.bias is not None
    attn.q_proj = ColumnParallelLinear(hidden, layout.q_rows, qkv_bias)
    attn.k_proj = ColumnParallelLinear(hidden, layout.kv_rows, qkv_bias)
    attn.v_proj = ColumnParallelLinear(hidden, layout.kv_rows, qkv_bias)
    attn.o_proj = RowParallelLinear(layout.q_rows, hidden, attn.o_proj.bias is not None, group)
    attn.num_qo_heads = layout.num_qo_heads
    attn.num_kv_heads = layout.num_kv_heads


def _shard_mlp(mlp: GatedMLP, rows: ShardSpec, hidden: int, group: TensorParallelGroup) -> None:
    bias = mlp.gate_proj.bias is not None
    mlp.gate_proj = ColumnParallelLinear(hidden, rows, bias)
    mlp.up_proj = ColumnParallelLinear(hidden, rows, bias)
    mlp.down_proj = RowParallelLinear(rows, hidden, bias, group)



def parameter_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the parameters tensor parallelism splits, bytes of those every rank holds
    whole: the norms) of `model`, a CausalLM or one rank's TensorParallelLM (for measuring
    the per-rank memory). Row-parallel biases, also whole, are counted with the split ones."""
    split = whole = 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        if name.endswith("norm.weight"):
            whole += size
        else:
            split += size
    return split, whole
