"""What a checkpoint says about generating from it: stop tokens and sampling defaults.

Read from a checkpoint directory's `generation_config.json` (falling back to config.json's
`eos_token_id`), or from a GGUF file's metadata (`tokenizer.ggml.eos_token_id`, the end-of-turn
ids, `general.sampling.*`). The engine decides how to apply them; the loader only reports them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

# GGUF metadata keys -> our field names (llama.cpp's sampling keys, gguf.Keys.General.SAMPLING_*).
_GGUF_SAMPLING_KEYS: dict[str, str] = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
# Tokens that end generation in llama.cpp: end of sequence, of turn, of message.
_GGUF_STOP_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                   "tokenizer.ggml.eom_token_id")
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """Stop token ids (possibly several) and the sampling parameters the checkpoint recommends;
    None where it states none."""

    stop_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_checkpoint_dir(cls, path: Path, config: PretrainedConfig) -> GenerationDefaults:
        """From `path/generation_config.json`; stop ids fall back to config.eos_token_id."""
        file = path / "generation_config.json"
        stated: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
        eos = stated.get("eos_token_id", getattr(config, "eos_token_id", None))
        sampling = {name: stated[name] for name in _SAMPLING_FIELDS if stated.get(name) is not None}
        return cls(stop_token_ids=_token_ids(eos), **_typed(sampling))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> GenerationDefaults:
        """From a GGUF file's metadata (see gguf_checkpoint.gguf_metadata)."""
        stops = [metadata[key] for key in _GGUF_STOP_KEYS if metadata.get(key) is not None]
        sampling = {name: metadata[key] for key, name in _GGUF_SAMPLING_KEYS.items() if key in metadata}
        return cls(stop_token_ids=_token_ids(stops), **_typed(sampling))


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """One id, a list of them or None -> a tuple without repeats, in order."""
    if value is None:
        return ()
    ids = [value] if isinstance(value, int) else value
    return tuple(dict.fromkeys(int(token) for token in ids))


def _typed(sampling: dict[str, Any]) -> dict[str, Any]:
    """top_k as int, the others as float."""
    return {name: int(value) if name == "top_k" else float(value) for name, value in sampling.items()}
