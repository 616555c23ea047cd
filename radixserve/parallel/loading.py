"""Loading one rank's shard: each rank reads only its slices of the checkpoint.

safetensors: `get_slice` reads the rank's rows or columns from the file, never the whole
tensor. GGUF: a tensor is dequantized whole (its block formats are not sliceable by rows in
general) and then sliced, so every rank reads the whole file; the shard alone stays in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from radixserve.models.generation_defaults import GenerationDefaults
from radixserve.models.gguf_checkpoint import (
    gguf_config,
    gguf_metadata,
    gguf_tensors,
    is_gguf_file,
    load_gguf_tokenizer,
    open_gguf,
    rope_frequency_divisors,
    tensor_shapes,
)
from radixserve.models.huge_pages import place_on_huge_pages
from radixserve.models.loader import (
    LoadedModel,
    check_architecture,
    check_complete,
    check_gguf_file,
    copy_tensors,
    load_tokenizer,
    max_context_len,
    resolve_dtype,
    weight_files,
)
from radixserve.models.registry import resolve_model
from radixserve.models.rope import RotaryEmbedding, inverse_frequencies
from radixserve.parallel.group import TensorParallelGroup
from radixserve.parallel.layers import ShardSpec
from radixserve.parallel.sharding import TensorParallelLM, check_layout


def load_shard(model: str, group: TensorParallelGroup, *, dtype: str | torch.dtype | None,
               device: torch.device, with_tokenizer: bool = True) -> LoadedModel:
    """Rank `group.rank`'s shard of `model` (a checkpoint directory, a .gguf file or a
    named model; not "demo") on `device`, as a LoadedModel. `with_tokenizer`: workers skip it
    (they see token ids only), and get None."""
    path, reader, metadata, config = _open(model)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device("meta"):
        shard = TensorParallelLM(config, group)
    shard = shard.to(torch_dtype).to_empty(device=device)
    placed = place_on_huge_pages(shard) > 0  # each weight written once, where it stays
    specs = shard.shard_specs()
    loaded: set[str] = set()
    if reader is not None:
        tensors = ((name, _take(specs.get(name), tensor)) for name, tensor in gguf_tensors(reader, config))
        copy_tensors(shard, tensors, path, loaded, adopt=not placed)
        divisors = rope_frequency_divisors(reader)
        if divisors is not None:  # as models/loader.py: llama.cpp's Llama 3.1 scaling
            shard.rotary = RotaryEmbedding(inverse_frequencies(config, shard.head_dim) / divisors)
        tokenizer = load_gguf_tokenizer(path) if with_tokenizer else None
        defaults = GenerationDefaults.from_gguf_metadata(metadata)
    else:
        for file in weight_files(path):
            copy_tensors(shard, _read_slices(file, specs), file, loaded)
        tokenizer = load_tokenizer(path) if with_tokenizer else None
        defaults = GenerationDefaults.from_checkpoint_dir(path, config)
    check_complete(shard, loaded, path)
    shard.eval().requires_grad_(False)
    return LoadedModel(model=shard, tokenizer=tokenizer, config=config, name=model,
                       max_context_len=max_context_len(config), dtype=torch_dtype, device=device,
                       generation_defaults=defaults)


def check_split(model: str, world_size: int) -> None:
    """ValueError, naming the heads or columns, when `model` cannot be split over
    `world_size` ranks: rank 0 checks before any worker starts (each then raised it alike, with
    its own traceback). A GGUF file is checked whole as a single process checks it
    (loader.check_gguf_file: metadata, tensor table and shapes, tokenizer), so that no rank
    allocates for a file claiming 5,000 layers or a 2**40-row vocabulary. Reads no weights."""
    path, reader, metadata, config = _open(model)
    if reader is not None:
        assert metadata is not None
        check_gguf_file(path, reader, metadata)
    heads = config.num_attention_heads
    check_layout(heads, getattr(config, "num_key_value_heads", None) or heads, config.intermediate_size, world_size)


def _open(model: str) -> tuple[Path, object, dict | None, PretrainedConfig]:
    """(path, GGUF reader or None, GGUF metadata or None, configuration) of `model`."""
    path = resolve_model(model)
    reader = open_gguf(path) if is_gguf_file(path) else None
    metadata = None
    if reader is not None:
        metadata = gguf_metadata(reader)
        config = gguf_config(metadata, tensor_shapes(reader))
    elif (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        raise ValueError(f"tensor parallelism needs a checkpoint directory or a .gguf file; {model!r} is neither")
    check_architecture(config)
    return path, reader, metadata, config


def _take(spec: ShardSpec | None, tensor: torch.Tensor) -> torch.Tensor:
    return tensor if spec is None else spec.take(tensor).contiguous()


def _read_slices(file: Path, specs: dict[str, ShardSpec]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's slice) of every tensor in the safetensors `file`, read by slice."""
    with safe_open(str(file), framework="pt", device="cpu") as tensors:
        for name in list(tensors.keys()):
            spec = specs.get(name)
            if spec is None:
                yield name, tensors.get_tensor(name)
                continue
            lazy = tensors.get_slice(name)
            index = [slice(None)] * len(lazy.get_shape())
            index[spec.dim] = slice(spec.start, spec.stop)
            yield name, spec.pad(lazy[tuple(index)])

