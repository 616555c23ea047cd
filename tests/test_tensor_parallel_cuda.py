"""Tensor parallelism on CUDA: NCCL between two GPUs, FlashInfer in bfloat16 on each rank.

Needs two GPUs and FlashInfer (skipped otherwise; bench/gpu_check.sh runs it). TP=2 against
TP=1, both through FlashInfer: greedy outputs "equal until a near-tie" (two correct bfloat16
computations that sum in a different order round differently; see test_flashinfer_engine.py),
under heavy eviction, preemption and the host tier (pinned host pools, side-stream loads on
every rank); then every rank's pool must hold its heads of every cached page.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("flashinfer")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="tensor parallelism on CUDA needs two GPUs (NCCL: one rank per GPU)"),
]

from radixserve import Engine, SamplingParams
from radixserve.models.demo import demo_checkpoint_dir
from tests.engine_util import cached_paths
from tests.test_flashinfer_engine import (
    assert_equal_until_a_near_tie,
    random_prompts,
    reference,  # noqa: F401 (a fixture)
)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_checkpoint_dir(tmp_path_factory.mktemp("demo"))


def test_tp2_through_flashinfer_equals_tp1_under_eviction_and_the_host_tier(demo_dir: Path, reference) -> None:
    prompts = random_prompts(120, seed=3)
    params = [SamplingParams(max_tokens=random.Random(i).randrange(2, 10), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    options = dict(device="cuda", dtype="bfloat16", backend="flashinfer", page_size=4, num_pages=24,
                   max_batch_tokens=64, host_num_pages=48, debug_checks=True)
    expected = Engine(str(demo_dir), **options).generate(prompts, params)
    tp = Engine(str(demo_dir), tensor_parallel_size=2, **options)
    try:
        got = tp.generate(prompts, params)
        stats = tp.stats()
        assert stats["preemptions"] > 0 and stats["kv_loaded_bytes"] > 0
        exact = [assert_equal_until_a_near_tie(reference, p, a.token_ids, b.token_ids)
                 for p, a, b in zip(prompts, got, expected)]
        assert sum(exact) >= 0.95 * len(exact), f"{len(exact) - sum(exact)} near-ties in {len(exact)}"
        for tokens, device_first, _ in cached_paths(tp):
            assert tp.runner.check_kv(tokens, device_first) == [None, None]
    finally:
        tp.close()
