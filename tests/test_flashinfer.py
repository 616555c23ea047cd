"""FlashInfer backend against the torch backend on CUDA (skipped without CUDA or FlashInfer)."""

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

from radixserve.attention import AttentionMetadata, TorchBackend, create_backend  # noqa: E402
from radixserve.attention.flashinfer_backend import FlashInferBackend  # noqa: E402
from radixserve.models import load_model  # noqa: E402
from radixserve.models.demo import demo_checkpoint_dir  # noqa: E402
from tests.model_helpers import PagedKV, Sequence, paged_step  # noqa: E402

PREFILL_SHAPES = [(37, 37), (1, 1), (29, 5), (16, 1), (9, 1), (300, 120), (64, 64), (130, 2)]


def run_both(
    shapes: list[tuple[int, int]], page_size: int, dtype: torch.dtype, sm_scale: float, seed: int,
    num_qo_heads: int = 8, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Outputs of the torch and FlashInfer backends on one random ragged paged batch
    (2 KV heads of 128); with `window`, planned for a full and a windowed layer, and the
    windowed layer's outputs returned."""
    rng = random.Random(seed)
    num_kv_heads, head_dim = 2, 128
    need = [-(-kv // page_size) for kv, _ in shapes]
    num_pages = sum(need) + 5
    ids = list(range(num_pages))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start : start + n])
        start += n
    generator = torch.Generator(device="cuda").manual_seed(seed)
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator, device="cuda").to(dtype)
    v_cache = torch.randn(cache_shape, generator=generator, device="cuda").to(dtype)
    num_tokens = sum(new for _, new in shapes)
    q = torch.randn(num_tokens, num_qo_heads, head_dim, generator=generator, device="cuda").to(dtype)
    meta = AttentionMetadata.build(
        tables, [kv for kv, _ in shapes], [new for _, new in shapes], page_size, "cuda"
    )
    outputs = []
    for backend in (TorchBackend(), create_backend("flashinfer", "cuda")):
        backend.plan(meta, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, dtype=dtype, windows=[None, window])
        outputs.append(backend.forward(q, k_cache, v_cache, sm_scale=sm_scale, window=window))
    return outputs[0], outputs[1], meta


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("num_qo_heads", [8, 16])  # group 4: CUDA-core decode; 8: tensor cores
def test_flashinfer_matches_torch_backend(dtype: torch.dtype, page_size: int, decode: bool,
                                          num_qo_heads: int) -> None:
    # Both backends accumulate in float32 and round the output to 16 bits, so they differ by
    # about one unit in the last place of the output: up to 0.016 for bfloat16 outputs in
    # [2, 4) (measured on the CPU against float32 attention rounded to bfloat16).
    rng = random.Random(page_size)
    shapes = [(rng.randint(1, 400), 1) for _ in range(9)] if decode else PREFILL_SHAPES
    expected, got, meta = run_both(shapes, page_size, dtype, 128**-0.5, seed=page_size,
                                   num_qo_heads=num_qo_heads)
    assert meta.is_decode == decode
    assert got.shape == expected.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("window", [1, 24, 100])
def test_flashinfer_sliding_window_matches_torch_backend(page_size: int, decode: bool, window: int) -> None:
    """window_left = window - 1 in FlashInfer is transformers' window (the torch backend's
    mask, checked against dense attention on the CPU), planned next to a full layer."""
    rng = random.Random(page_size + window)
    shapes = [(rng.randint(1, 400), 1) for _ in range(9)] if decode else PREFILL_SHAPES
    expected, got, meta = run_both(shapes, page_size, torch.bfloat16, 128**-0.5, seed=window,
                                   window=window)
    assert meta.is_decode == decode
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_flashinfer_honours_a_custom_softmax_scale() -> None:
    expected, got, _ = run_both(PREFILL_SHAPES, 16, torch.bfloat16, 0.5 / math.sqrt(128), seed=3)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_create_backend_prefers_flashinfer_on_cuda() -> None:
    assert isinstance(create_backend(None, "cuda"), FlashInferBackend)


def test_decode_plans_the_tensor_core_wrapper_for_large_groups() -> None:
    backend = FlashInferBackend("cuda")
    for num_qo_heads, tensor_cores in ((8, False), (16, True)):
        meta = AttentionMetadata.build([[0, 1, 2], [3, 4, 5, 6, 7]], [33, 70], [1, 1], 16, "cuda")
        backend.plan(meta, num_qo_heads=num_qo_heads, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16)
        assert backend._planned[None].use_tensor_cores == tensor_cores


def test_demo_model_agrees_across_backends(tmp_path: Path) -> None:
    """Prefill then teacher-forced decode steps of the demo model in bfloat16."""
    demo = load_model(str(demo_checkpoint_dir(tmp_path)), dtype="bfloat16", device="cuda")
    model = demo.model
    prompt = demo.tokenizer.encode("The river town of Alder Bend woke slowly on market days.")
    continuation = demo.tokenizer.encode(" Mara kept the library and sorted the books.")
    logits = {}
    for name in ("torch", "flashinfer"):
        backend = create_backend(name, "cuda")
        kv = PagedKV(model, num_pages=16, page_size=4, seed=1)
        seq = Sequence()
        steps = paged_step(model, kv, [(seq, prompt)], backend=backend, all_logits=True)
        for token in continuation:
            steps += paged_step(model, kv, [(seq, [token])], backend=backend, all_logits=True)
        logits[name] = torch.cat(steps)
    # Two correct bfloat16 attentions (float32 accumulation, outputs rounded to bfloat16 in
    # every layer) give these logits about 2 bfloat16 units in the last place apart at the
    # largest logit: 0.125 at max |logit| 8.9, measured on the CPU between the torch backend
    # and float32 attention rounded to bfloat16. Allow 4 (FlashInfer's split-KV reductions
    # sum in another order): 2.8% of the largest logit here; it was 5%.
    scale = float(logits["torch"].abs().max())
    ulp = 2.0 ** (math.floor(math.log2(scale)) - 7)  # bfloat16: 8 significant bits
    assert float((logits["flashinfer"] - logits["torch"]).abs().max()) <= 4 * ulp
