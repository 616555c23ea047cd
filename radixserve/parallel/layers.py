"""Megatron-style sharded layers: column- and row-parallel linears, vocab-parallel embedding.

Each layer holds only its rank's slice; `ShardSpec` says which slice of the checkpoint's
full tensor that is, so the loader reads only those bytes. Parameter names stay HF's
(`weight`, `bias`), so a sharded model loads from the same checkpoint names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixserve.models.layers import linear
from radixserve.parallel.group import TensorParallelGroup


@dataclass(frozen=True)
class ShardSpec:
    """The slice [start, stop) of a full tensor along `dim` that one rank holds, zero-padded
    to `length` along that dimension (the vocabulary when it does not divide evenly)."""

    dim: int
    start: int
    stop: int
    length: int

    def take(self, full: Tensor) -> Tensor:
        """This rank's part of the full tensor `full`."""
        part = full.narrow(self.dim, self.start, self.stop - self.start)
        return self.pad(part)

    def pad(self, part: Tensor) -> Tensor:
        """`part` (the slice) padded with zeros up to `length`."""
        missing = self.length - part.shape[self.dim]
        if missing <= 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], dim=self.dim)


def even_split(total: int, parts: int, index: int, what: str) -> ShardSpec:
    """Part `index` of `parts` equal slices of `total` rows (ValueError unless they divide)."""
    if total % parts:
        raise ValueError(f"{what}: {total} is not divisible by tensor_parallel_size {parts}")
    size = total // parts
    return ShardSpec(0, index * size, (index + 1) * size, size)


class ColumnParallelLinear(nn.Module):
    """y[:, rows] = x @ W[rows]^T (+ b[rows]): the output stays sharded; no communication."""

    def __init__(self, in_features: int, rows: ShardSpec, bias: bool) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.empty(rows.length, in_features))
        self.bias = nn.Parameter(torch.empty(rows.length)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """x [T, in] -> [T, rows]."""
        return linear(x, self.weight, self.bias)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> its slice of the checkpoint tensor."""
        specs = {"weight": self.rows}
        if self.bias is not None:
            specs["bias"] = self.rows
        return specs


class RowParallelLinear(nn.Module):
    """y = all_reduce(x[:, cols] @ W[:, cols]^T) + b: the input arrives sharded (a column-
    parallel output); the bias, replicated, is added once after the sum."""

    def __init__(self, cols: ShardSpec, out_features: int, bias: bool, group: TensorParallelGroup) -> None:
        super().__init__()
        self.cols = ShardSpec(1, cols.start, cols.stop, cols.length)
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, cols.length))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """x [T, cols] -> [T, out], summed over the ranks."""
        y = self.group.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> its slice of the checkpoint tensor (the bias is whole)."""
        return {"weight": self.cols}


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, stop) of the embedding table (padded to an equal share);
    a token outside them contributes zeros, and the all-reduce assembles the embedding.
    The same rows serve as this rank's slice of a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.rows = vocab_rows(vocab_size, group.world_size, group.rank)
        self.group = group
        self.weight = nn.Parameter(torch.empty(self.rows.length, hidden_size))

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> [T, hidden]."""
        local = input_ids - self.rows.start
        outside = (local < 0) | (local >= self.rows.stop - self.rows.start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> its slice of the checkpoint tensor."""
        return {"weight": self.rows}


def vocab_rows(vocab_size: int, world_size: int, rank: int) -> ShardSpec:
    """Rank `rank`'s rows of a vocabulary split in equal shares (the last one padded)."""
    share = -(-vocab_size // world_size)
    start = min(rank * share, vocab_size)
    return ShardSpec(0, start, min(start + share, vocab_size), share)
