"""The host tier on CUDA: pinned host pool, offload on the compute stream, load-back on a side
stream (skipped without CUDA; runs as it is on a GPU machine).

Checks what the CPU cannot: loads return a handle that completes later, the scheduler runs a
sequence only once its copy is done, and the outputs equal those with ample device memory.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve import SamplingParams
from tests.test_engine import make_engine, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


@pytest.mark.parametrize("write_policy", ["write-back", "exclusive"])
def test_side_stream_loads_give_the_same_tokens_as_ample_memory(ckpt: Path, write_policy: str) -> None:
    """Under `exclusive` a loaded page's host copy is freed only once its load is done: an
    offload reusing those host pages earlier would overwrite what the load still reads."""
    prompts = random_prompts(160, seed=11)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    ample = make_engine(ckpt, device="cuda", num_pages=1024).generate(prompts, params)
    torch_pinned_before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    tight = make_engine(ckpt, device="cuda", num_pages=24, max_batch_tokens=64, host_num_pages=48,
                        host_write_policy=write_policy)
    host_k = tight.host_tier.pool._k_all
    assert host_k.is_pinned() and tight.host_tier.pool.v_cache[0].is_pinned()
    # Registered with the driver at its own size (cache/pinned.py), not taken from torch's
    # pinned allocator, which rounds each tensor up to a power of two.
    torch_pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) - torch_pinned_before
    assert torch_pinned < host_k.numel() * host_k.element_size(), torch_pinned
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ample]
    stats = tight.stats()
    assert stats["cache_loaded_pages"] > 0 and stats["host_cached_tokens"] > 0
    if write_policy == "exclusive":
        return
    # The copier itself: a load is issued on the side stream and completes on its own.
    host_pool, device_pool = tight.host_tier.pool, tight.pool
    host_page = next(h for node, _ in tight.tree.nodes() if node.host for h in node.host)
    (device_page,) = device_pool.allocate(1)
    handle = tight.host_tier.copier.load([host_page], [device_page])
    assert handle is not None
    torch.cuda.synchronize()
    assert handle.done()
    assert torch.equal(device_pool.k_cache[0][device_page].cpu(), host_pool.k_cache[0][host_page])
    device_pool.decref([device_page])
    tight.flush_cache()
    assert tight.host_tier.pool.num_free == tight.host_tier.pool.num_pages
