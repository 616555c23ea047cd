"""transformers' own greedy generation: the reference the engine tests compare with."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM


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
