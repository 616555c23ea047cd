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


def cached_paths(engine) -> list[tuple[list[int], list[int], list[int]]]:
    """Every cached leaf path of `engine`'s tree as (tokens, pages device-first, pages
    host-first); host page h is written as pool.num_pages + h (the joined device and host
    caches' row)."""
    offset = engine.pool.num_pages
    paths = []
    for leaf, _ in engine.tree.nodes():
        if leaf.children or leaf.is_root:
            continue
        path, node = [], leaf
        while not node.is_root:
            path.insert(0, node)
            node = node.parent
        tokens = [t for n in path for t in n.tokens.tolist()]
        device_first = [p for n in path for p in (n.pages or [offset + h for h in n.host])]
        host_first = [p for n in path for p in ([offset + h for h in n.host] if n.host is not None else n.pages)]
        paths.append((tokens, device_first, host_first))
    return paths
