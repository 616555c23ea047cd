"""A `--model` string -> model, tokenizer, config and generation defaults, ready to serve.

`model` is resolved by models/registry.py ("demo", a named model such as "smollm2", a local
path, or a Hub id downloaded once). A checkpoint directory holds config.json, the weights
(model.safetensors, or shards listed in model.safetensors.index.json) and the tokenizer files;
a GGUF file holds all of it and is translated by models/gguf_checkpoint.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from gguf import GGUFReader
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from radixserve.models.generation_defaults import GenerationDefaults
from radixserve.models.gguf_checkpoint import (
    ROPE_FREQS_TENSOR,
    check_chat_template,
    check_tensor_table,
    gguf_config,
    gguf_metadata,
    gguf_tensors,
    hf_tensor_name,
    is_gguf_file,
    load_gguf_tokenizer,
    open_gguf,
    rope_frequency_divisors,
    tensor_shapes,
)
from radixserve.models.huge_pages import place_on_huge_pages
from radixserve.models.llama import CausalLM
from radixserve.models.registry import NAMED_MODELS, resolve_model
from radixserve.models.rope import RotaryEmbedding, inverse_frequencies

# Architecture name (config.architectures) -> model_type, for configs that lack one or the other.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Checkpoint entries that are not parameters of ours (older exports carry the RoPE table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs to know about it."""

    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    name: str
    max_context_len: int
    dtype: torch.dtype
    device: torch.device
    # stop token ids and sampling defaults stated by the checkpoint (for the engine to apply)
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)


def load_model(
    model: str = "demo", *, dtype: str | torch.dtype | None = None, device: str | None = None
) -> LoadedModel:
    """Load `model`: "demo" (the built-in random-weight model), a named model ("smollm2", see
    models/registry.py), a local checkpoint directory, a local .gguf file or a Hub id "org/name".

    dtype: "float32", "bfloat16", "float16", "auto" or None (= "auto": the checkpoint's dtype
    on CUDA, float32 on CPU), or a torch.dtype; GGUF weights are dequantized to it.
    device: None picks CUDA when available.
    Raises FileNotFoundError naming the missing path (ModelNotInstalledError /
    HubUnavailableError for a named model or Hub id that cannot be had), ValueError for an
    unsupported architecture (listing the supported ones), GGUF storage type or dtype.
    """
    path = resolve_model(model)
    if is_gguf_file(path):
        return load_gguf_model(path, name=model, dtype=dtype, device=device)
    if path.is_file():  # an existing file that is not GGUF: "not found" would send one looking elsewhere
        with path.open("rb") as file:
            magic = file.read(4)
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF'); a Hugging Face "
                         f"checkpoint is loaded from its directory")
    if not path.is_dir():
        raise FileNotFoundError(f"model not found: {str(path)!r} is no checkpoint directory, .gguf file, "
                                f"Hub id (org/name) or named model ({', '.join(['demo', *NAMED_MODELS])})")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_architecture(config)
    tokenizer = load_tokenizer(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, torch_device)

    causal_lm = empty_model(config, torch_dtype, torch_device)
    place_on_huge_pages(causal_lm)  # the weights are then written once, where they stay
    load_weights(causal_lm, path)
    causal_lm.eval().requires_grad_(False)

    return LoadedModel(
        model=causal_lm,
        tokenizer=tokenizer,
        config=config,
        name=model,
        max_context_len=max_context_len(config),
        dtype=torch_dtype,
        device=torch_device,
        generation_defaults=GenerationDefaults.from_checkpoint_dir(path, config),
    )


def resolve_device(device: str | None) -> torch.device:
    """`device` as a torch.device (None: CUDA when present, else the CPU). Raises ValueError
    naming the devices this torch has when `device` is not one of them."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device: {device!r} is not a torch device ({exc})") from None
    available = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if resolved.type == "cuda" and (not torch.cuda.is_available() or (resolved.index or 0) >= torch.cuda.device_count()):
        built = "this torch has no CUDA support" if torch.version.cuda is None else "no such GPU is visible"
        raise ValueError(f"device: {device!r} is not available ({built}); available: {', '.join(available)}")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r} is not supported; available: {', '.join(available)}")
    return resolved


def load_gguf_model(
    path: Path, *, name: str, dtype: str | torch.dtype | None = None, device: str | None = None
) -> LoadedModel:
    """Load the GGUF file `path` (see load_model for dtype and device; "auto" on CUDA is
    bfloat16, since a GGUF's block formats are no serving dtype).

    Everything that can be checked without the weights is checked before any parameter is
    allocated (`check_gguf_file`): a hostile or broken file is refused in milliseconds with
    a ValueError naming it, not after minutes of dequantizing or a terabyte allocation."""
    reader = open_gguf(path)
    try:
        metadata = gguf_metadata(reader)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    checked = check_gguf_file(path, reader, metadata)
    config, divisors = checked.config, checked.rope_divisors
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, config, torch_device)

    causal_lm = materialize(checked.skeleton, torch_dtype, torch_device)
    loaded: set[str] = set()
    # Dequantized into their place on huge pages, or adopted as they come (no second buffer).
    placed = place_on_huge_pages(causal_lm) > 0
    copy_tensors(causal_lm, gguf_tensors(reader, config), path, loaded, adopt=not placed)
    check_complete(causal_lm, loaded, path)
    if divisors is not None:  # llama.cpp divides each frequency by its factor (Llama 3.1 scaling)
        causal_lm.rotary = RotaryEmbedding(inverse_frequencies(config, causal_lm.head_dim) / divisors)
    causal_lm.eval().requires_grad_(False)

    return LoadedModel(
        model=causal_lm,
        tokenizer=checked.tokenizer,
        config=config,
        name=name,
        max_context_len=max_context_len(config),
        dtype=torch_dtype,
        device=torch_device,
        generation_defaults=checked.generation_defaults,
    )


class CheckedGGUF(NamedTuple):
    """What a GGUF file says, checked before its weights are read (see check_gguf_file)."""

    config: PretrainedConfig
    skeleton: CausalLM  # on the meta device: the parameters' shapes, nothing allocated
    tokenizer: PreTrainedTokenizerBase
    rope_divisors: torch.Tensor | None  # rope_freqs.weight (Llama 3.1 scaling), if the file has it
    generation_defaults: GenerationDefaults


def check_gguf_file(path: Path, reader: GGUFReader, metadata: dict[str, Any]) -> CheckedGGUF:
    """The GGUF file's config, its model on the meta device, tokenizer, RoPE divisors and
    generation defaults, each checked against the others.

    The metadata is checked for presence, type and range (gguf_config), the tensor table for
    names, storage types and block count (check_tensor_table) and every tensor's shape against
    the model's parameter; then the tokenizer, which costs a fraction of a second, where it
    once came after the minutes of loading. Raises ValueError beginning with `path`.
    """
    try:
        config = gguf_config(metadata, tensor_shapes(reader))
        check_architecture(config)
        check_tensor_table(reader, config)  # before the skeleton: block_count bounds its size
        skeleton = meta_model(config)
        check_tensor_shapes(skeleton, reader)
        divisors = rope_frequency_divisors(reader)
        if divisors is not None and divisors.numel() != skeleton.head_dim // 2:
            raise ValueError(f"tensor {ROPE_FREQS_TENSOR!r} has {divisors.numel()} values, not one per "
                             f"rotated pair ({skeleton.head_dim // 2})")
        check_chat_template(metadata)
        tokenizer = load_gguf_tokenizer(path)
        if len(tokenizer) > config.vocab_size:  # ids past the embedding would be refused per prompt
            raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the {config.vocab_size} "
                             f"rows of the embedding")
        defaults = checked_generation_defaults(metadata)
    except ValueError as exc:
        if str(path) in str(exc):
            raise
        raise ValueError(f"{path}: {exc}") from exc
    return CheckedGGUF(config, skeleton, tokenizer, divisors, defaults)


def check_tensor_shapes(skeleton: CausalLM, reader: GGUFReader) -> None:
    """ValueError when a tensor of the file does not have its parameter's shape, or some
    parameter has no tensor: the shapes follow from the metadata, so a file whose metadata
    claims a 2**30-wide embedding over a 64-wide tensor is refused here, not by the allocator."""
    params = {name: tuple(param.shape) for name, param in skeleton.named_parameters()}
    found: set[str] = set()
    for gguf_name, shape in tensor_shapes(reader).items():
        if gguf_name == ROPE_FREQS_TENSOR:
            continue
        name = hf_tensor_name(gguf_name)
        if name == "lm_head.weight" and skeleton.tie_word_embeddings:
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {gguf_name!r}")
        if shape != params[name]:
            raise ValueError(f"{name}: checkpoint shape {shape} != model shape {params[name]} (from the metadata)")
        found.add(name)
    missing = sorted(set(params) - found)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def checked_generation_defaults(metadata: dict[str, Any]) -> GenerationDefaults:
    """The file's stop tokens and sampling defaults; ValueError naming a sampling default
    outside what a request may ask for. Refused at load because the engine applies them to
    every request that leaves them unset, and each such request was then refused with a 400
    naming a field the client never sent."""
    try:
        defaults = GenerationDefaults.from_gguf_metadata(metadata)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"GGUF metadata: a stop token id or general.sampling.* value is not a number ({exc})") from None
    # (key, value, allowed?, what is allowed): the ranges SamplingParams.validate accepts
    checks = [
        ("general.sampling.temp", defaults.temperature, lambda v: 0.0 <= v <= 2.0, "in [0, 2]"),
        ("general.sampling.top_p", defaults.top_p, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
        ("general.sampling.top_k", defaults.top_k, lambda v: v >= 0, ">= 0 (0 = off)"),
        ("general.sampling.penalty_repeat", defaults.repetition_penalty, lambda v: 0.0 < v < math.inf,
         "finite and > 0"),
    ]
    for key, value, allowed, wanted in checks:
        if value is not None and not allowed(value):  # NaN fails every comparison, so it is refused too
            raise ValueError(f"GGUF metadata {key} must be {wanted}, got {value!r}")
    return defaults


def meta_model(config: PretrainedConfig) -> CausalLM:
    """A CausalLM for `config` on the meta device: its parameters' shapes, no memory."""
    with torch.device("meta"):
        return CausalLM(config)


def materialize(skeleton: CausalLM, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """`skeleton` (from meta_model) with uninitialised parameters of `dtype` on `device`.

    MemoryError saying how much did not fit where: torch.OutOfMemoryError (CUDA) and the CPU
    allocator's "can't allocate memory" are RuntimeErrors, which `serve` would print as a
    traceback rather than as a model it cannot load."""
    try:
        return skeleton.to(dtype).to_empty(device=device)
    except RuntimeError as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(exc):
            raise
        size = sum(param.numel() for param in skeleton.parameters()) * dtype.itemsize
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise MemoryError(f"out of memory: {size / 2**30:.1f} GiB of {dtype} parameters do not fit on "
                          f"{device}: {first}") from None


def empty_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """A CausalLM for `config` with uninitialised parameters of `dtype` on `device` (built on
    the meta device, so nothing is computed that the weights overwrite)."""
    return materialize(meta_model(config), dtype, device)


def check_architecture(config: PretrainedConfig) -> str:
    """The architecture of `config` if we support it; else ValueError naming it and listing
    the supported ones."""
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    model_type = getattr(config, "model_type", None)
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        architecture = architectures[0]
    else:  # configs written by hand may name only the model type
        by_type = {known: name for name, known in SUPPORTED_ARCHITECTURES.items()}
        architecture = by_type.get(model_type, f"model_type {model_type!r}")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r} (supported: {supported})")
    if SUPPORTED_ARCHITECTURES[architecture] != model_type:
        raise ValueError(f"architecture {architecture!r} does not match model_type {model_type!r}")
    return architecture


def resolve_dtype(
    dtype: str | torch.dtype | None, config: PretrainedConfig, device: torch.device
) -> torch.dtype:
    """The parameter dtype for `dtype` (see load_model)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(stored, torch.dtype):
            return stored
        return DTYPES.get(str(stored), torch.bfloat16)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (choose from: auto, {', '.join(DTYPES)})")
    return DTYPES[dtype]


def max_context_len(config: PretrainedConfig) -> int:
    """Longest sequence the model serves: max_position_embeddings (a sliding window does not
    cap it: windowed layers attend to their window, see models/llama.py `layer_windows`)."""
    return int(config.max_position_embeddings)


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint in `path` (sharded or not)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / shard for shard in shards]
    else:
        files = [path / "model.safetensors"]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"weight file not found: {file}")
    return files


def load_weights(model: CausalLM, path: Path) -> None:
    """Copy the checkpoint's tensors into the parameters of the same name (casting dtype).

    Raises ValueError on a missing parameter, an unknown tensor or a shape mismatch.
    """
    loaded: set[str] = set()
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as tensors:
                names = list(tensors.keys())  # safe_open is not a mapping
                copy_tensors(model, ((name, tensors.get_tensor(name)) for name in names), file, loaded)
        except SafetensorError as exc:  # a truncated or garbled file: said as such, not a traceback
            raise ValueError(f"{file}: not a readable safetensors file (corrupt or truncated?): {exc}") from None
    check_complete(model, loaded, path)


@torch.no_grad()
def copy_tensors(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], source: Path, loaded: set[str],
    *, adopt: bool = False,
) -> None:
    """Copy each (name, tensor) into the parameter of that name, casting dtype and device, and
    add the name to `loaded`. Raises ValueError naming `source` on an unknown tensor or a shape
    mismatch; skips what is not a parameter of ours (an old RoPE table, a tied lm_head).

    adopt: the parameter takes over the (cast) tensor's storage instead of copying it, for
    tensors made just for this model (dequantized ones): no second buffer to fill.
    """
    params = dict(model.named_parameters())
    for name, tensor in tensors:
        if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.tie_word_embeddings):
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} in {source}")
        if tensor.shape != params[name].shape:
            raise ValueError(
                f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                f"{tuple(params[name].shape)} ({source})"
            )
        param = params[name]
        if adopt:
            param.data = tensor.to(device=param.device, dtype=param.dtype)
        else:
            param.copy_(tensor)
        loaded.add(name)


def check_complete(model: CausalLM, loaded: set[str], source: Path) -> None:
    """ValueError when some parameter of `model` is not in `loaded`."""
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        raise ValueError(f"checkpoint {source} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer (local files only)."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                     "tokenizer.model")):
        raise FileNotFoundError(f"no tokenizer files in model directory {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
