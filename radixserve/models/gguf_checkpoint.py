"""A llama.cpp GGUF file -> a transformers config, our parameter names and dequantized tensors.

GGUF keeps the config as metadata under llama.cpp's key names (`llama.block_count`, ...), the
tensors under llama.cpp's names (`blk.0.attn_q.weight`), often block-quantized, and the
tokenizer and chat template as metadata too. This module translates all three so the rest of
the engine sees an ordinary Llama-family model:

- config: a PretrainedConfig of the file's model_type (llama, mistral, qwen2, qwen3), built from
  the metadata; no `output.weight` tensor means tied embeddings.
- weights: read with `gguf.GGUFReader`, dequantized by `gguf.quants` (vectorised numpy) to
  float32, then cast to the serving dtype. llama.cpp's converter permutes the rows of the Llama
  (and Mistral, written as arch "llama") q/k projections from HF's rotate-half RoPE layout to
  its interleaved one; `unpermute_rope_rows` undoes it. Qwen2/Qwen3 files are not permuted.
- tokenizer: transformers builds it from the file (`gguf_file=`), chat template included.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from struct import error as struct_error
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

# GGUF `general.architecture` -> model_type. Mistral is written as "llama" (see gguf_model_type).
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
ARCHITECTURE_NAMES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Storage types we dequantize (with gguf.quants); anything else is refused by name.
SUPPORTED_TENSOR_TYPES: tuple[GGMLQuantizationType, ...] = tuple(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
)
# Architectures whose converter interleaves the q/k rows (llama.cpp's LlamaModel.permute).
_PERMUTED_ARCHITECTURES = ("llama",)
# Metadata arrays longer than this (the vocabulary, merges, scores) are not decoded here:
# GGUFReader has parsed them already, but turning 50k entries into Python strings is wasted time.
_MAX_METADATA_ARRAY = 64

_LAYER_TENSORS: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3.1 files: per-frequency divisors, not a parameter


def is_gguf_file(path: Path) -> bool:
    """Whether `path` is a file starting with the GGUF magic bytes."""
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


class PlainArrayGGUFReader(GGUFReader):
    """gguf's reader, slicing a plain ndarray view of the mapped file instead of the np.memmap.

    The reader takes a slice of its mapping for every metadata value and tensor, and a slice of
    a np.memmap is a new memmap object whose `__array_finalize__` runs each time: a 49k-token
    vocabulary takes about 1.3M of them (3.4 s of SmolLM2's 9 s load on two cores). A plain view
    of the same mapping reads the same bytes, still mapped, in a third of the time."""

    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, mapped: np.ndarray) -> None:  # GGUFReader.__init__ assigns its np.memmap here
        self._plain_data = mapped.view(np.ndarray)


def open_gguf(path: Path) -> GGUFReader:
    """The reader over `path` (memory-mapped: tensors are read when dequantized); ValueError
    naming the file when it cannot be read as GGUF (gguf's own errors on a truncated or
    garbled file are IndexErrors and numpy messages that never say so)."""
    try:
        return PlainArrayGGUFReader(path)
    except (IndexError, ValueError, KeyError, struct_error, OverflowError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from None


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's metadata as plain values: scalars, strings and short arrays (long arrays such
    as the vocabulary are left out; the tokenizer reads them itself)."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY and len(field.data) > _MAX_METADATA_ARRAY:
            continue
        value = field.contents()
        metadata[key] = value.item() if isinstance(value, np.generic) else value
    return metadata


def gguf_model_type(metadata: dict[str, Any]) -> str:
    """The transformers model_type of the file; ValueError naming an unsupported architecture.

    llama.cpp writes Mistral models as architecture "llama"; like transformers, a file whose
    `general.name` is "mistral" is read as a Mistral.
    """
    architecture = metadata.get("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        supported = ", ".join(GGUF_ARCHITECTURES)
        raise ValueError(f"unsupported GGUF architecture {architecture!r} (supported: {supported})")
    if architecture == "llama" and str(metadata.get("general.name", "")).lower() == "mistral":
        return "mistral"
    return GGUF_ARCHITECTURES[architecture]


def tensor_shapes(reader: GGUFReader) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in torch order ([rows, cols]; ggml lists the fastest dim first)."""
    return {tensor.name: tuple(int(d) for d in reversed(tensor.shape.tolist())) for tensor in reader.tensors}


def gguf_config(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> PretrainedConfig:
    """A transformers config of the file's model_type, from its metadata and tensor shapes."""
    model_type = gguf_model_type(metadata)
    arch = metadata["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden_size // num_heads
    names = set(shapes)
    # older files state no vocab_size: the embedding's row count says it
    vocab_size = key("vocab_size") or shapes["token_embd.weight"][0]
    fields: dict[str, Any] = dict(
        architectures=[ARCHITECTURE_NAMES[model_type]],
        vocab_size=int(vocab_size),
        hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(metadata, arch),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )
    if model_type in ("llama", "qwen3"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type == "llama":
        fields["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    if model_type == "mistral":
        fields["sliding_window"] = key("attention.sliding_window")
    return AutoConfig.for_model(model_type, **fields)


def _rope_parameters(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """RoPE settings in transformers 5's `rope_parameters` form (default or linear scaling)."""
    theta = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        factor = float(metadata[f"{arch}.rope.scaling.factor"])
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling {scaling!r} (supported: none, linear)")


def hf_tensor_name(gguf_name: str) -> str:
    """Our (= HF's) parameter name for a llama.cpp tensor name; ValueError for an unknown one."""
    for gguf_prefix, hf_prefix in _GLOBAL_TENSORS.items():
        if gguf_name == f"{gguf_prefix}.weight":
            return f"{hf_prefix}.weight"
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    raise ValueError(f"unexpected tensor {gguf_name!r} in GGUF file")


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (rows [heads * head_dim] of a weight or bias).

    llama.cpp writes, per head, the rows (0, half, 1, half + 1, ...) -- the two halves of HF's
    rotate-half layout interleaved in pairs; this puts them back to (0, 1, ..., half - 1, half, ...).
    """
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor: Any) -> np.ndarray:
    """The float32 values of a GGUFReader tensor in torch's shape order ([rows, cols]).

    ValueError naming the storage type when it is not one of SUPPORTED_TENSOR_TYPES.
    """
    kind = tensor.tensor_type
    if kind not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        name = getattr(kind, "name", str(kind))
        raise ValueError(f"tensor {tensor.name!r} is stored as {name}, which radixserve cannot "
                         f"dequantize (supported: {supported})")
    values = dequantize(tensor.data, kind)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists the fastest dim first
    return np.asarray(values, dtype=np.float32).reshape(shape)


def gguf_tensors(reader: GGUFReader, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter name, float32 tensor) for each weight of the file, q/k rows unpermuted.

    `rope_freqs.weight` (not a parameter) is skipped: see `rope_frequency_divisors`.
    """
    permuted = reader.fields["general.architecture"].contents() in _PERMUTED_ARCHITECTURES
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            continue
        name = hf_tensor_name(tensor.name)
        values = dequantized(tensor)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            values = unpermute_rope_rows(values, config.num_attention_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            values = unpermute_rope_rows(values, config.num_key_value_heads)
        # F32/F16 values are views of the read-only memory map; torch wants writable arrays
        yield name, torch.from_numpy(values if values.flags.writeable else values.copy())


def rope_frequency_divisors(reader: GGUFReader) -> torch.Tensor | None:
    """Llama 3.1 GGUFs carry their RoPE scaling as `rope_freqs.weight`: llama.cpp divides each
    rotation frequency by its entry. None when the file has no such tensor."""
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return torch.from_numpy(dequantized(tensor).reshape(-1).copy())
    return None


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) stored in the file, built by transformers offline.

    The fast-tokenizer class directly, not AutoTokenizer: AutoTokenizer first re-parses the
    whole file (vocabulary included) with GGUFReader only to learn the model type, which costs
    seconds, and then builds this same class.
    """
    return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
