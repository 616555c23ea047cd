"""Shared pieces of the engine tests: a tiny checkpoint on disk and transformers' reference."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from radixserve.models.demo import demo_checkpoint_dir


def write_tiny_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A 2-layer random Llama with the demo tokenizer, written with save_pretrained."""
    tokenizer = AutoTokenizer.from_pretrained(demo_checkpoint_dir())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Random init gives near-uniform logits; a wider spread makes greedy choices robust to the
    # float noise between differently shaped batches.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@lru_cache(maxsize=4)
def hf_model(directory: str) -> LlamaForCausalLM:
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def hf_greedy(directory: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (stops at EOS, as the engine does)."""
    model = hf_model(str(directory))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()
