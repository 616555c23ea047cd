"""One decoder-only model for the Llama family (Llama, Mistral, Qwen2, Qwen3) over paged KV.

The variants differ only in small switches read from the transformers config: biases on the
attention projections (Qwen2: q/k/v; Llama/Qwen3: `attention_bias`), per-head RMSNorm of q and
k before RoPE (Qwen3), MLP biases (Llama `mlp_bias`), tied embeddings, an explicit
`head_dim`. Module and parameter names equal HF's, so loading a checkpoint is a straight copy.

The batch is flat: the new tokens of all sequences are concatenated (`input_ids` [T]); the
attention metadata says which sequence, position and KV slot each token has.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from radixserve.attention.base import AttentionBackend, AttentionMetadata, write_kv
from radixserve.models.decoder_kernel import decoder_weights, layer_rows
from radixserve.models.layers import Embedding, GatedMLP, Linear, RMSNorm, linear, linear_many
from radixserve.models.rope import RotaryEmbedding, inverse_frequencies, rotary_qk
from radixserve.native.decoder import DecoderWeights, run_layers
from radixserve.native.paged_attention import PagedRows

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(config: PretrainedConfig) -> list[int | None]:
    """Each layer's sliding attention window (it attends to at most that many positions,
    its own included), or None for full attention.

    Mistral: `sliding_window` on every layer. Qwen2 / Qwen3: `sliding_window` only with
    `use_sliding_window`, on layers from `max_window_layers` on. transformers v5 spells the
    result out as `config.layer_types`, which wins where present. Llama: none.
    """
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        window = None
    num_layers = config.num_hidden_layers
    if not window:
        return [None] * num_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        first = getattr(config, "max_window_layers", 0) if config.model_type in ("qwen2", "qwen3") else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise ValueError(f"unsupported layer_types {unknown or types!r} (supported: {', '.join(LAYER_TYPES)})")
    return [int(window) if kind == "sliding_attention" else None for kind in types]


@dataclass(frozen=True)
class Variant:
    """The switches that tell the family members apart."""

    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    mlp_bias: bool

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> Variant:
        """Read the switches for `config.model_type` (one of SUPPORTED_MODEL_TYPES)."""
        model_type = config.model_type
        attention_bias = bool(getattr(config, "attention_bias", False))
        if model_type == "qwen2":
            return cls(qkv_bias=True, o_bias=False, qk_norm=False, mlp_bias=False)
        if model_type == "qwen3":
            return cls(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True, mlp_bias=False)
        if model_type == "llama":
            mlp_bias = bool(getattr(config, "mlp_bias", False))
            return cls(
                qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=False, mlp_bias=mlp_bias
            )
        if model_type == "mistral":
            return cls(qkv_bias=False, o_bias=False, qk_norm=False, mlp_bias=False)
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )


class Attention(nn.Module):
    """Grouped-query self-attention that writes its new K/V into the paged cache."""

    def __init__(self, config: PretrainedConfig, head_dim: int, variant: Variant,
                 window: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.window = window  # sliding window (None: full attention)
        self.num_qo_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.sm_scale = head_dim**-0.5
        self.q_proj = Linear(hidden, self.num_qo_heads * head_dim, bias=variant.qkv_bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=variant.qkv_bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, bias=variant.qkv_bias)
        self.o_proj = Linear(self.num_qo_heads * head_dim, hidden, bias=variant.o_bias)
        if variant.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        num_tokens = x.shape[0]
        q, k, v = linear_many(x, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(num_tokens, self.num_qo_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary_qk(q, k, cos, sin)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = backend.forward(q, k_cache, v_cache, sm_scale=self.sm_scale, window=self.window)
        return self.o_proj(out.reshape(num_tokens, self.num_qo_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm attention block then pre-norm MLP block, each with a residual connection."""

    def __init__(self, config: PretrainedConfig, head_dim: int, variant: Variant,
                 window: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, head_dim, variant, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, variant.mlp_bias)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> Tensor:
        """x [T, hidden] -> [T, hidden]; x itself is the residual stream and is updated in place."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, meta, backend, k_cache, v_cache)
        return x.add_(self.mlp(self.post_attention_layernorm.add_and_norm(x, attended)))


class DecoderStack(nn.Module):
    """Embeddings, decoder layers and final norm: HF's `model.` submodule."""

    def __init__(self, config: PretrainedConfig, head_dim: int, variant: Variant) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, head_dim, variant, window) for window in layer_windows(config)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _every_row(indices: Tensor, rows: int) -> bool:
    """Whether `indices` (int64 on the CPU) are 0 .. rows - 1 in order."""
    if len(indices) != rows or indices.device.type != "cpu":
        return False
    host = indices.numpy()
    return rows == 1 and host[0] == 0 or bool((host == np.arange(rows)).all())


class CausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 causal LM over a paged KV cache."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden_act = getattr(config, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (supported: silu)")
        variant = Variant.from_config(config)
        self.config = config
        self.head_dim: int = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.num_layers: int = config.num_hidden_layers
        self.num_qo_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.vocab_size: int = config.vocab_size
        self.model = DecoderStack(config, self.head_dim, variant)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.rotary = RotaryEmbedding(inverse_frequencies(config, self.head_dim))
        self.layer_windows: list[int | None] = layer_windows(config)
        # All-decode CPU steps run the layer stack in one C call (models/decoder_kernel.py);
        # False keeps every step on the per-layer path (the tests compare the two).
        self.use_decoder_kernel = True
        self._decoder_weights: DecoderWeights | None | bool = False  # False: not looked at yet

    @property
    def kv_window(self) -> int | None:
        """The sliding window of every layer (the largest, if they differ), or None when some
        layer attends to the whole sequence: then no page can ever be released early."""
        windows = self.layer_windows
        return None if not windows or None in windows else max(w for w in windows if w is not None)

    @property
    def attention_windows(self) -> list[int | None]:
        """The distinct windows of the layers (None: full attention), each planned per step."""
        return list(dict.fromkeys(self.layer_windows))

    def plan_attention(self, backend: AttentionBackend, meta: AttentionMetadata, dtype: torch.dtype) -> None:
        """Plan `backend` for a step of this model (its head layout and layer windows); call
        once per step, before `forward`. `dtype`: of the queries and the K/V caches."""
        backend.plan(meta, num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim, dtype=dtype, windows=self.attention_windows)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        k_caches: list[Tensor],
        v_caches: list[Tensor],
        logits_indices: Tensor,
    ) -> Tensor:
        """Run one step and return float32 logits [len(logits_indices), vocab].

        input_ids: int64 [T], the new tokens of all sequences in `meta.qo_indptr` order.
        `backend` must already be planned for `meta` (`AttentionBackend.plan`, once per
        step). Writes every layer's new K/V into `k_caches[l]` / `v_caches[l]`
        ([num_pages, page_size, num_kv_heads, head_dim], the model's dtype) at
        `meta.slot_mapping`, and computes logits only for the rows `logits_indices` of [T].
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(meta.positions, x.dtype)
        weights, rows = self._decoder_kernel(backend, x)
        if weights is not None and rows is not None:
            # Where every row yields logits (a decode step), the kernel norms them all too.
            every_row = _every_row(logits_indices, len(x))
            normed = run_layers(x, cos, sin, meta.slot_mapping, weights, k_caches, v_caches, rows, final_norm=every_row)
            if normed is not None:
                return self.compute_logits(normed)
        else:
            for layer, k_cache, v_cache in zip(self.model.layers, k_caches, v_caches, strict=True):
                x = layer(x, cos, sin, meta, backend, k_cache, v_cache)
        return self.compute_logits(self.model.norm(x[logits_indices]))

    def _decoder_kernel(self, backend: AttentionBackend, x: Tensor) -> tuple[DecoderWeights | None,
                                                                             list[PagedRows] | None]:
        """The kernel's view of the weights and this step's rows per layer, when the step can
        run in one C call (else a None)."""
        if not self.use_decoder_kernel:
            return None, None
        if self._decoder_weights is False:  # looked at once: the parameters are kept, not copied
            self._decoder_weights = decoder_weights(self)
        weights = self._decoder_weights
        if not isinstance(weights, DecoderWeights):
            return None, None
        return weights, layer_rows(self, backend, x, weights)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """The LM head: normed hidden states [n, hidden] -> float32 logits [n, vocab] (the
        seam where tensor parallelism gathers its vocabulary shards, radixserve/parallel)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()
