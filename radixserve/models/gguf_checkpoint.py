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

import math
import re
from collections.abc import Iterator
from pathlib import Path
from struct import error as struct_error
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
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
# Any other array is decoded whatever its length (a per-layer value), up to this: past it a
# file could make the loader build a Python list of a hundred million values from 400 MB.
MAX_OTHER_METADATA_ARRAY = 65536

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

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: Literal["I", "S", "<"] | None = None) -> np.ndarray:
        """gguf's `_get`, refusing a read past the end of the file.

        gguf slices the mapping, and a slice past the end is empty rather than an error: an
        array whose length field says 2**40 over 3 bytes of data then loops 2**40 times without
        advancing, appending to lists (a 56-byte file hung the loader with growing memory)."""
        count = int(count)
        end = int(offset) + np.dtype(dtype).itemsize * count
        if count < 0 or end > len(self._plain_data):
            raise ValueError(f"a field at byte {offset} ({count} x {np.dtype(dtype).name}) runs past the end "
                             f"of the file ({len(self._plain_data)} bytes)")
        return super()._get(offset, dtype, count, override_order)


def open_gguf(path: Path) -> GGUFReader:
    """The reader over `path` (memory-mapped: tensors are read when dequantized); ValueError
    naming the file when it cannot be read as GGUF (gguf's own errors on a truncated or
    garbled file are IndexErrors and numpy messages that never say so)."""
    try:
        reader = PlainArrayGGUFReader(path)
    except (IndexError, ValueError, KeyError, struct_error, OverflowError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file (corrupt or truncated?): {exc}") from None
    if reader.byte_order == "S":  # gguf.quants dequantizes as little-endian: every weight would be garbage
        raise ValueError(f"{path}: big-endian GGUF files are not supported")
    return reader


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's metadata as plain values: scalars, strings and arrays, except the tokenizer's
    long arrays (the vocabulary, merges, scores: the tokenizer reads them itself). Other arrays
    are kept whatever their length: a per-layer value (`head_count_kv` of an 80-layer model) left
    out would read as missing and fall back to a default silently."""
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        if field.types[0] == GGUFValueType.ARRAY and len(field.data) > _MAX_METADATA_ARRAY:
            if key.startswith("tokenizer."):
                continue
            if len(field.data) > MAX_OTHER_METADATA_ARRAY:
                raise ValueError(f"GGUF metadata {key} is an array of {len(field.data):,} values; at most "
                                 f"{MAX_OTHER_METADATA_ARRAY:,} outside the tokenizer's")
        try:
            value = field.contents()
        except UnicodeDecodeError as exc:  # gguf's message names neither the key nor the file
            raise ValueError(f"GGUF metadata {key} is not valid UTF-8: {exc}") from None
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
    """A transformers config of the file's model_type, from its metadata and tensor shapes.

    Every value is checked for presence, type and range first: a file is untrusted input, and
    without the checks a missing key was `int(None)`, a head count of 0 a ZeroDivisionError and
    an odd head size a huggingface_hub validation error, each a traceback instead of a refusal.
    Raises ValueError naming the key (the loader adds the file's path)."""
    model_type = gguf_model_type(metadata)
    arch = metadata["general.architecture"]

    def count(name: str, *, minimum: int = 1, default: int | None = None) -> int:
        value = metadata_int(metadata, f"{arch}.{name}", minimum=minimum, default=default)
        assert value is not None  # required, or with an int default
        return value

    def optional(name: str) -> int | None:  # absent, or 0 for "not stated" as llama.cpp writes it
        return metadata_int(metadata, f"{arch}.{name}", minimum=0, required=False) or None

    hidden_size = count("embedding_length")
    num_heads = count("attention.head_count")
    num_kv_heads = count("attention.head_count_kv", default=num_heads)
    if num_heads % num_kv_heads:  # each KV head serves a whole group of query heads
        raise ValueError(f"GGUF metadata {arch}.attention.head_count {num_heads} is not a multiple of "
                         f"{arch}.attention.head_count_kv {num_kv_heads}")
    head_dim = optional("attention.key_length") or optional("rope.dimension_count") or hidden_size // num_heads
    if head_dim < 2 or head_dim % 2:  # RoPE rotates pairs of dimensions
        raise ValueError(f"GGUF metadata of {arch}: head size {head_dim} is not a positive even number "
                         f"(embedding_length {hidden_size}, head_count {num_heads})")
    names = set(shapes)
    vocab_size = optional("vocab_size")
    if vocab_size is None:  # older files state no vocab_size: the embedding's row count says it
        embedding = shapes.get("token_embd.weight")
        if embedding is None or len(embedding) != 2:
            raise ValueError(f"GGUF file has neither {arch}.vocab_size nor a 2-D token_embd.weight tensor")
        vocab_size = embedding[0]
    fields: dict[str, Any] = dict(
        architectures=[ARCHITECTURE_NAMES[model_type]],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=count("feed_forward_length"),
        num_hidden_layers=count("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=count("context_length"),
        rms_norm_eps=metadata_float(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, above=0.0),
        rope_parameters=_rope_parameters(metadata, arch),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_token_id(metadata, "tokenizer.ggml.bos_token_id", vocab_size),
        eos_token_id=_token_id(metadata, "tokenizer.ggml.eos_token_id", vocab_size),
        pad_token_id=_token_id(metadata, "tokenizer.ggml.padding_token_id", vocab_size),
    )
    if model_type in ("llama", "qwen3"):
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    if model_type == "llama":
        fields["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    if model_type == "mistral":
        fields["sliding_window"] = metadata_int(metadata, f"{arch}.attention.sliding_window", minimum=0,
                                                required=False)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # transformers' and huggingface_hub's validation errors are no ValueErrors
        raise ValueError(f"transformers refuses the config from the GGUF metadata: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from exc


def metadata_int(metadata: dict[str, Any], key: str, *, minimum: int = 1, default: int | None = None,
                 required: bool = True) -> int | None:
    """The integer at `key`, at least `minimum`; `default` (or None when not `required`) when absent.

    A per-layer array (llama.cpp allows one for the head and FFN sizes) is taken when all its
    values are equal; this engine builds every layer alike, so differing values are refused.
    ValueError naming the key for a missing, non-integer or out-of-range value."""
    value = metadata.get(key)
    if value is None:
        if default is not None or not required:
            return default
        raise ValueError(f"GGUF metadata {key} is missing")
    if isinstance(value, list):
        if not value or any(item != value[0] for item in value):
            shown = f"{value[:8]}{'...' if len(value) > 8 else ''}"
            raise ValueError(f"GGUF metadata {key} differs per layer ({shown}): radixserve builds every "
                             f"layer alike and cannot serve that")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):  # bool is an int to Python
        raise ValueError(f"GGUF metadata {key} must be an integer, not {value!r}")
    if value < minimum:
        raise ValueError(f"GGUF metadata {key} must be >= {minimum}, got {value}")
    return value


def metadata_float(metadata: dict[str, Any], key: str, default: float, *, above: float | None = None,
                   at_least: float | None = None) -> float:
    """The finite number at `key` (`default` when absent), > `above` and >= `at_least` where given.

    A NaN or infinite RoPE base or norm epsilon loads and then turns every logit into NaN, so
    each request fails instead of the load. ValueError naming the key otherwise."""
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"GGUF metadata {key} must be a number, not {value!r}")
    number = float(value)
    if not math.isfinite(number) or (above is not None and number <= above) or (
            at_least is not None and number < at_least):
        bound = f"> {above:g}" if above is not None else f">= {at_least:g}"
        raise ValueError(f"GGUF metadata {key} must be a finite number {bound}, got {number!r}")
    return number


def _token_id(metadata: dict[str, Any], key: str, vocab_size: int) -> int | None:
    """The special-token id at `key`, None when absent; ValueError for a non-integer or one
    outside the vocabulary (transformers' tokenizer builder fails on it with an IndexError)."""
    value = metadata_int(metadata, key, minimum=0, required=False)
    if value is not None and value >= vocab_size:
        raise ValueError(f"GGUF metadata {key} {value} is outside the vocabulary of {vocab_size} tokens")
    return value


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message (pydantic-style errors run to many lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _rope_parameters(metadata: dict[str, Any], arch: str) -> dict[str, Any]:
    """RoPE settings in transformers 5's `rope_parameters` form (default or linear scaling);
    ValueError naming the key for a base that is not finite and > 0, or a linear scaling whose
    factor is missing or below 1 (a factor below 1 would extrapolate, not interpolate)."""
    theta = metadata_float(metadata, f"{arch}.rope.freq_base", 10000.0, above=0.0)
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling in ("none", None):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling == "linear":
        factor_key = f"{arch}.rope.scaling.factor"
        if factor_key not in metadata:
            raise ValueError(f"GGUF metadata {factor_key} is missing (rope.scaling.type is linear)")
        factor = metadata_float(metadata, factor_key, 1.0, at_least=1.0)
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling {scaling!r} (supported: none, linear)")


def check_tensor_table(reader: GGUFReader, config: PretrainedConfig) -> None:
    """Check the tensor table against the config before anything is allocated: every name
    known, every storage type one we dequantize, and a blk.N tensor for exactly the
    `block_count` layers. Only names and types are read, no tensor data.

    Without this a 376 KiB file claiming 5000 layers built all 5000 (18 s) before its missing
    tensors were noticed. The shapes are compared with the model's parameters by the loader.
    ValueError naming the tensor or the key."""
    layers: set[int] = set()
    for tensor in reader.tensors:
        if tensor.name != ROPE_FREQS_TENSOR:
            hf_tensor_name(tensor.name)
        check_storage_type(tensor)
        match = _LAYER_NAME.fullmatch(tensor.name)
        if match:
            layers.add(int(match.group(1)))
    _check_no_overlap(reader)
    expected = config.num_hidden_layers
    if layers != set(range(expected)):
        arch = reader.fields["general.architecture"].contents()
        found = sorted(layers)
        shown = ", ".join(map(str, found[:8])) + (f", ... {found[-1]}" if len(found) > 8 else "")
        raise ValueError(f"GGUF metadata {arch}.block_count is {expected} (blocks 0 to {expected - 1}), but the "
                         f"file has tensors for {len(found)} blocks: {shown or 'none'}")


def _check_no_overlap(reader: GGUFReader) -> None:
    """ValueError when two tensors' data overlap. llama.cpp writes each tensor after the one
    before and refuses anything else; a file whose tensors share bytes would load as a silently
    wrong model (gguf's reader already refuses data past the end of the file)."""
    spans = sorted((int(tensor.data_offset), int(tensor.n_bytes), tensor.name) for tensor in reader.tensors)
    for (start, size, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        if next_start < start + size:
            raise ValueError(f"tensors {name!r} and {next_name!r} overlap in the file (bytes {start} to "
                             f"{start + size} and from {next_start})")


def check_chat_template(metadata: dict[str, Any]) -> None:
    """ValueError when the file's chat template is not a string or does not compile: each chat
    request would fail on it (a 400 blaming the messages) while the server looked healthy.
    Compiled by transformers' own compiler, the one `apply_chat_template` uses (and caches)."""
    template = metadata.get("tokenizer.chat_template")
    if template is None:
        return
    if not isinstance(template, str):
        raise ValueError(f"GGUF metadata tokenizer.chat_template must be a string, not {template!r}")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a private function: without it the template is checked per request, as before
        return
    from jinja2.exceptions import TemplateSyntaxError

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"GGUF metadata tokenizer.chat_template does not compile: {exc.message} "
                         f"(template line {exc.lineno})") from None
    except MemoryError:  # Jinja folds constants as it compiles: `{{ 'a' * 3000000000 }}` is built here
        raise ValueError("GGUF metadata tokenizer.chat_template does not compile: it builds a constant "
                         "larger than the memory there is") from None


def check_storage_type(tensor: Any) -> None:
    """ValueError naming the tensor and its storage type when it is not one we dequantize."""
    kind = tensor.tensor_type
    if kind not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        name = getattr(kind, "name", str(kind))
        raise ValueError(f"tensor {tensor.name!r} is stored as {name}, which radixserve cannot "
                         f"dequantize (supported: {supported})")


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
    check_storage_type(tensor)
    values = dequantize(tensor.data, tensor.tensor_type)
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
            divisors = torch.from_numpy(dequantized(tensor).reshape(-1).copy())
            # a zero, negative or NaN divisor loads and makes every logit NaN: refused here instead
            if not bool(torch.isfinite(divisors).all()) or bool((divisors <= 0).any()):
                raise ValueError(f"tensor {ROPE_FREQS_TENSOR!r} holds values that are not finite and > 0")
            return divisors
    return None


def load_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) stored in the file, built by transformers offline.

    The fast-tokenizer class directly, not AutoTokenizer: AutoTokenizer first re-parses the
    whole file (vocabulary included) with GGUFReader only to learn the model type, which costs
    seconds, and then builds this same class.

    Raises ValueError for any failure: transformers' GGUF tokenizer builder answers a file
    without tokens or merges with a KeyError, an out-of-range special-token id with an
    IndexError and a token missing from the vocabulary with a bare Exception, and `serve`
    reports only ValueErrors (and OSErrors) as a file it cannot load.
    """
    try:
        return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except OSError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot build the tokenizer stored in the GGUF file: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from exc
