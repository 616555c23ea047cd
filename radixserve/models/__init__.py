"""Models over paged KV: the Llama family, checkpoint loading (HF directories, GGUF files,
named models, Hub ids), the demo model, the KV check."""

from radixserve.models.demo import demo_checkpoint_dir
from radixserve.models.generation_defaults import GenerationDefaults
from radixserve.models.kv_check import verify_cached_kv
from radixserve.models.llama import CausalLM
from radixserve.models.loader import SUPPORTED_ARCHITECTURES, LoadedModel, load_model

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "GenerationDefaults",
    "LoadedModel",
    "demo_checkpoint_dir",
    "load_model",
    "verify_cached_kv",
]
