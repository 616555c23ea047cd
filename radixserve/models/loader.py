"""Local HF checkpoint directory (or "demo") -> model, tokenizer and config, ready to serve.

Nothing is downloaded: `model` is a directory holding config.json, the weights
(model.safetensors, or shards listed in model.safetensors.index.json) and the tokenizer files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from radixserve.models.demo import demo_checkpoint_dir
from radixserve.models.llama import CausalLM

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


def load_model(
    model: str = "demo", *, dtype: str | torch.dtype | None = None, device: str | None = None
) -> LoadedModel:
    """Load `model`: "demo" (the built-in random-weight model) or a local checkpoint directory.

    dtype: "float32", "bfloat16", "float16", "auto" or None (= "auto": the checkpoint's dtype
    on CUDA, float32 on CPU), or a torch.dtype. device: None picks CUDA when available.
    Raises FileNotFoundError naming the missing path, ValueError for an unsupported
    architecture (listing the supported ones) or a bad dtype.
    """
    path = demo_checkpoint_dir() if model == "demo" else Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_architecture(config)
    tokenizer = load_tokenizer(path)
    torch_device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = resolve_dtype(dtype, config, torch_device)

    with torch.device("meta"):
        causal_lm = CausalLM(config)
    causal_lm = causal_lm.to(torch_dtype).to_empty(device=torch_device)
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
    )


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


@torch.no_grad()
def load_weights(model: CausalLM, path: Path) -> None:
    """Copy the checkpoint's tensors into the parameters of the same name (casting dtype).

    Raises ValueError on a missing parameter, an unknown tensor or a shape mismatch.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for file in weight_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and model.tie_word_embeddings
                ):
                    continue
                if name not in params:
                    raise ValueError(f"unexpected tensor {name!r} in {file}")
                tensor = tensors.get_tensor(name)
                if tensor.shape != params[name].shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape "
                        f"{tuple(params[name].shape)} ({file})"
                    )
                params[name].copy_(tensor)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer (local files only)."""
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                     "tokenizer.model")):
        raise FileNotFoundError(f"no tokenizer files in model directory {path}")
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
