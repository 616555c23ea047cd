"""The engine through FlashInfer in bfloat16 against the torch backend on the same weights.

GPU only (skipped without CUDA and FlashInfer): greedy generation, the cache-hit path and
heavy eviction with preemption, each run by an engine on the FlashInfer backend and compared
with the torch backend (the reference everywhere else). Two correct bfloat16 attentions
round differently, so greedy outputs are compared as "equal until a near-tie": where the two
first differ, the torch backend's logits for both tokens must be within 4 bfloat16 units in
the last place of the largest logit (the spread two correct bfloat16 attentions show on the
demo model is 2, see test_flashinfer.py); after that point the continuations may differ.

Uses the demo model (head_dim 64, which FlashInfer's kernels support; the tiny test models'
16 is not), built offline from its recipe.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer needs CUDA"),
]

from radixserve import Engine, SamplingParams  # noqa: E402
from radixserve.attention import TorchBackend, create_backend  # noqa: E402
from radixserve.attention.flashinfer_backend import FlashInferBackend  # noqa: E402
from radixserve.models import load_model  # noqa: E402
from radixserve.models.demo import demo_checkpoint_dir, windowed_demo_dir  # noqa: E402
from radixserve.models.kv_check import verify_cached_kv  # noqa: E402
from tests.model_helpers import PagedKV, Sequence, paged_step  # noqa: E402

ULPS = 4


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_checkpoint_dir(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def reference(demo_dir: Path):  # -> Callable[[list[int]], torch.Tensor]
    """Teacher-forced float32 logits [len(tokens), vocab] of the bfloat16 model through the
    torch backend, in one prefill."""
    model = load_model(str(demo_dir), dtype="bfloat16", device="cuda").model

    def logits(tokens: list[int]) -> torch.Tensor:
        kv = PagedKV(model, num_pages=len(tokens) // 16 + 2, page_size=16)
        (out,) = paged_step(model, kv, [(Sequence(), tokens)], backend=TorchBackend(), all_logits=True)
        return out.float()

    return logits


def make_engine(demo_dir: Path, backend: str, **kwargs) -> Engine:
    kwargs.setdefault("page_size", 4)
    kwargs.setdefault("num_pages", 512)
    engine = Engine(str(demo_dir), device="cuda", dtype="bfloat16", backend=backend, debug_checks=True,
                    **kwargs)
    assert isinstance(engine.runner.backend, FlashInferBackend if backend == "flashinfer" else TorchBackend)
    return engine


def random_prompts(n: int, seed: int, groups: int = 5, prefix_len: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 2000) for _ in range(prefix_len)] for _ in range(groups)]
    return [prefixes[rng.randrange(groups)][: rng.randrange(4, prefix_len + 1)]
            + [rng.randrange(3, 2000) for _ in range(rng.randrange(1, 12))] for _ in range(n)]


def assert_equal_until_a_near_tie(reference, prompt: list[int], got: list[int], expected: list[int]) -> bool:
    """True when equal; else the first difference must be a near-tie under the reference."""
    if got == expected:
        return True
    i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    assert i < min(len(got), len(expected)), f"one output is a prefix of the other: {got} vs {expected}"
    row = reference(prompt + expected[:i])[-1]
    ulp = 2.0 ** (math.floor(math.log2(float(row.abs().max()))) - 7)
    gap = float(row[expected[i]] - row[got[i]])
    assert abs(gap) <= ULPS * ulp, f"token {i}: {got[i]} vs {expected[i]}, logit gap {gap:.4f} > {ULPS} ulps"
    return False


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_through_flashinfer_equals_the_torch_backend(demo_dir: Path, reference, page_size: int) -> None:
    prompts = random_prompts(6, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ours = make_engine(demo_dir, "flashinfer", page_size=page_size).generate(prompts, params)
    theirs = make_engine(demo_dir, "torch", page_size=page_size).generate(prompts, params)
    exact = [assert_equal_until_a_near_tie(reference, p, a.token_ids, b.token_ids)
             for p, a, b in zip(prompts, ours, theirs)]
    assert sum(exact) >= len(exact) - 1, "more than one near-tie in six prompts"


def test_cache_hit_path_through_flashinfer(demo_dir: Path, reference) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    system = list(range(10, 50))
    engine = make_engine(demo_dir, "flashinfer")
    assert engine.generate([system + [7, 8, 9]], params)[0].cached_tokens == 0
    prompt = system + [60, 61]
    hit = engine.generate([prompt], params)[0]
    assert hit.cached_tokens == len(system)  # token-deep: the partial page is copied too
    fresh = make_engine(demo_dir, "torch", enable_prefix_cache=False).generate([prompt], params)[0]
    assert_equal_until_a_near_tie(reference, prompt, hit.token_ids, fresh.token_ids)
    match = engine.tree.match(system, (engine.model_name, None), update=False)
    assert len(match.pages) == len(system) // 4
    bad = verify_cached_kv(engine.loaded.model, engine.pool.k_cache, engine.pool.v_cache, system,
                           match.pages, 4, backend=create_backend("flashinfer", "cuda", torch.bfloat16))
    assert bad is None


def test_heavy_eviction_and_preemption_through_flashinfer(demo_dir: Path, reference) -> None:
    prompts = random_prompts(200, seed=7)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    tight = make_engine(demo_dir, "flashinfer", num_pages=24, max_batch_tokens=64)
    squeezed = tight.generate(prompts, params)
    stats = tight.stats()
    assert stats["preemptions"] > 0 and stats["cache_evicted_pages"] > 0
    ample = make_engine(demo_dir, "torch", num_pages=1024).generate(prompts, params)
    exact = [assert_equal_until_a_near_tie(reference, p, a.token_ids, b.token_ids)
             for p, a, b in zip(prompts, squeezed, ample)]
    assert sum(exact) >= 0.95 * len(exact), f"{len(exact) - sum(exact)} near-ties in {len(exact)}"
    freed = tight.flush_cache()
    assert freed == stats["pages_cached"] and tight.pool.num_free == tight.pool.num_pages


@pytest.mark.parametrize("mixed", [False, True])
def test_sliding_window_through_flashinfer_equals_the_torch_backend(tmp_path: Path,
                                                                    mixed: bool) -> None:
    """The demo weights with a window of 16 on every layer (pages are released) or on layers
    2-3 after two full ones (two plans per step), generating several windows past it, cold
    and after a cache hit: FlashInfer (window_left) against the torch backend."""
    windowed = windowed_demo_dir(tmp_path / "windowed", 16, full_layers=2 if mixed else 0)
    model = load_model(str(windowed), dtype="bfloat16", device="cuda").model
    assert model.layer_windows == ([None, None, 16, 16] if mixed else [16] * 4)

    def reference(tokens: list[int]) -> torch.Tensor:
        kv = PagedKV(model, num_pages=len(tokens) // 16 + 2, page_size=16)
        (out,) = paged_step(model, kv, [(Sequence(), tokens)], backend=TorchBackend(), all_logits=True)
        return out.float()

    prompts = random_prompts(6, seed=3, prefix_len=40)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for page_size in (1, 16):
        ours = make_engine(windowed, "flashinfer", page_size=page_size)
        theirs = make_engine(windowed, "torch", page_size=page_size).generate(prompts, params)
        for _ in range(2):  # cold, then warm in the cache
            exact = [assert_equal_until_a_near_tie(reference, p, a.token_ids, b.token_ids)
                     for p, a, b in zip(prompts, ours.generate(prompts, params), theirs)]
            assert sum(exact) >= len(exact) - 1, "more than one near-tie in six prompts"
