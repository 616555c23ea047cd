"""Paged attention: the per-step batch metadata and the backends that consume it."""

from radixserve.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    create_backend,
    flashinfer_available,
    write_kv,
)
from radixserve.attention.torch_backend import TorchBackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "TorchBackend",
    "create_backend",
    "flashinfer_available",
    "write_kv",
]
