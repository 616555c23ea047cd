"""Test helpers: tiny random HF checkpoints and a minimal paged runner around CausalLM.

The runner is deliberately naive (one Python object per sequence, pages handed out from a
shuffled free list so block tables are never contiguous); it is the test's stand-in for the
engine, so model tests do not depend on the scheduler or the page pool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.torch_backend import TorchBackend
from radixserve.models.demo import build_tokenizer
from radixserve.models.llama import CausalLM

TINY_VOCAB = 320  # 256 bytes + 3 specials + 61 merges
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}


def tiny_configs(vocab_size: int) -> dict[str, PretrainedConfig]:
    """One small config per supported variant, covering every switch of the family."""
    common = dict(_COMMON, vocab_size=vocab_size)
    return {
        "llama": LlamaConfig(**common, tie_word_embeddings=False),
        "llama3_rope": LlamaConfig(**common, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=False),
        "llama_tied_bias": LlamaConfig(
            **common, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
        ),
        "mistral": MistralConfig(**common, sliding_window=None, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=False),
    }


TINY_MODEL_NAMES = tuple(tiny_configs(TINY_VOCAB))


def windowed_configs(vocab_size: int, window: int) -> dict[str, PretrainedConfig]:
    """Tiny models with a sliding window of `window` tokens: Mistral (every layer windowed)
    and Qwen2 with use_sliding_window and max_window_layers=1 (transformers windows layers
    from max_window_layers on: layer 0 full, layers 1 and 2 windowed)."""
    common = dict(_COMMON, vocab_size=vocab_size)
    return {
        "mistral_window": MistralConfig(**common, sliding_window=window, tie_word_embeddings=False),
        "qwen2_window": Qwen2Config(**dict(common, num_hidden_layers=3), use_sliding_window=True,
                                    sliding_window=window, max_window_layers=1, tie_word_embeddings=True),
    }


WINDOWED_MODEL_NAMES = tuple(windowed_configs(TINY_VOCAB, 8))


def write_tiny_checkpoint(name: str, directory: Path, seed: int = 0, *, window: int | None = None) -> Path:
    """Save a random tiny model `name` (see tiny_configs; with `window`, windowed_configs)
    with a tokenizer into `directory`.

    Weights are redrawn with O(1) activations (linear N(0, 1/fan_in), embeddings
    N(0, 0.25^2), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2)) so that attention is far from
    uniform and positions, masks and norms all change the logits measurably. Each name gets
    its own weights.
    """
    names = TINY_MODEL_NAMES + WINDOWED_MODEL_NAMES
    seed += names.index(name)
    tokenizer = build_tokenizer(TINY_VOCAB, max_length=512)
    configs = tiny_configs(len(tokenizer)) if window is None else windowed_configs(len(tokenizer), window)
    return save_random_checkpoint(configs[name], tokenizer, directory, seed)


def save_random_checkpoint(config: PretrainedConfig, tokenizer: PreTrainedTokenizerFast, directory: Path,
                           seed: int) -> Path:
    """Save a model of `config` with redrawn weights (see redraw_weights) and `tokenizer`, its
    special-token ids set from the tokenizer's ChatML tokens, into `directory`."""
    config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config.pad_token_id = config.bos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    redraw_weights(model, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@torch.no_grad()
def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Redraw an HF model's weights with O(1) activations (see write_tiny_checkpoint)."""
    generator = torch.Generator().manual_seed(seed)
    for param_name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=generator)
        if param_name.endswith("norm.weight"):
            param.copy_(1 + 0.1 * noise)
        elif param_name.endswith(".bias"):
            param.copy_(0.1 * noise)
        elif param_name.endswith("embed_tokens.weight"):
            param.copy_(0.25 * noise)
        else:
            param.copy_(noise * param.shape[1] ** -0.5)


def load_reference(directory: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model for a checkpoint (eager attention: independent of SDPA)."""
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()


@torch.no_grad()
def reference_logits(hf_model: torch.nn.Module, tokens: list[int]) -> Tensor:
    """float32 logits [len(tokens), vocab] of one sequence from transformers."""
    return hf_model(torch.tensor([tokens])).logits[0].float()


@dataclass
class Sequence:
    """A sequence in the paged runner: its tokens and the pages holding their K/V."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading tokens whose K/V are in the pages


class PagedKV:
    """Per-layer K/V pages of one model (on its device, in its dtype) and a free list
    handed out in shuffled order."""

    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        weight = model.model.embed_tokens.weight
        dtype = dtype or weight.dtype
        self.device = weight.device
        shape = (num_pages, page_size, model.num_kv_heads, model.head_dim)
        self.page_size = page_size
        # NaN-filled: any read of a slot that was never written poisons the result.
        self.k = [torch.full(shape, float("nan"), dtype=dtype, device=self.device)
                  for _ in range(model.num_layers)]
        self.v = [torch.full(shape, float("nan"), dtype=dtype, device=self.device)
                  for _ in range(model.num_layers)]
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        """Append pages to `seq.block_table` until it covers `num_tokens` tokens."""
        while len(seq.block_table) * self.page_size < num_tokens:
            seq.block_table.append(self.free.pop())


def paged_step(
    model: CausalLM,
    kv: PagedKV,
    work: list[tuple[Sequence, list[int]]],
    *,
    backend: AttentionBackend | None = None,
    all_logits: bool = False,
) -> list[Tensor]:
    """One forward over several sequences, each with its new tokens (possibly none).

    Returns per sequence the logits of its last new token ([vocab]) or, with `all_logits`,
    of all its new tokens ([n, vocab]).
    """
    for seq, new in work:
        kv.ensure_capacity(seq, seq.num_cached + len(new))
    meta = AttentionMetadata.build(
        [seq.block_table for seq, _ in work],
        [seq.num_cached + len(new) for seq, new in work],
        [len(new) for _, new in work],
        kv.page_size,
        kv.device,
    )
    input_ids = torch.tensor([t for _, new in work for t in new], dtype=torch.int64, device=kv.device)
    rows: list[list[int]] = []
    start = 0
    for _, new in work:
        end = start + len(new)
        rows.append(list(range(start, end)) if all_logits else ([end - 1] if new else []))
        start = end
    backend = backend or TorchBackend()
    model.plan_attention(backend, meta, model.model.embed_tokens.weight.dtype)
    logits_indices = torch.tensor(sum(rows, []), dtype=torch.int64, device=kv.device)
    logits = model(input_ids, meta, backend, kv.k, kv.v, logits_indices)
    for seq, new in work:
        seq.num_cached += len(new)
    per_sequence = list(torch.split(logits, [len(seq_rows) for seq_rows in rows]))
    return per_sequence if all_logits else [c[0] if len(c) else c for c in per_sequence]


def paged_greedy(
    model: CausalLM, prompt: list[int], max_new_tokens: int, page_size: int, *, seed: int = 0
) -> list[int]:
    """Greedy generation: one prefill step, then one decode step per token."""
    kv = PagedKV(model, num_pages=(len(prompt) + max_new_tokens) // page_size + 2,
                 page_size=page_size, seed=seed)
    seq = Sequence()
    (logits,) = paged_step(model, kv, [(seq, prompt)])
    generated = [int(logits.argmax())]
    while len(generated) < max_new_tokens:
        (logits,) = paged_step(model, kv, [(seq, generated[-1:])])
        generated.append(int(logits.argmax()))
    return generated
