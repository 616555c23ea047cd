"""The fused CPU kernels of a decoder layer (residual add + RMSNorm, RoPE, silu * up): equal
to the torch path they replace (bit for bit in bfloat16, to rounding in float32), checked before
any C runs, and wired into the model so that its logits do not move when they are turned off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixserve.models import layers, rope
from radixserve.models.layers import RMSNorm
from radixserve.models.loader import load_model
from radixserve.models.rope import apply_rotary, rotary_qk
from radixserve.native import fused_ops

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:  # the kernels round where torch rounds
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-6)


def test_the_kernels_build_on_this_machine() -> None:
    assert fused_ops.library() is not None, fused_ops.unavailable_reason()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 576 rows take the parallel branch
def test_add_rms_norm_equals_the_torch_path(dtype: torch.dtype, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, generator=generator).to(dtype)
    x = (torch.randn(rows, 576, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=generator).to(dtype)
    expected_stream = x + delta
    expected = norm._torch_forward(expected_stream)
    stream = x.clone()
    got = fused_ops.add_rms_norm(stream, delta, norm.weight, norm.eps)
    assert torch.equal(stream, expected_stream)  # the residual stream is updated in place
    _close(got, expected, dtype)
    plain = x.clone()
    _close(fused_ops.add_rms_norm(plain, None, norm.weight, norm.eps), norm._torch_forward(x), dtype)
    assert torch.equal(plain, x)  # without a delta x is only read
    # the module's entry points agree, whichever path they take at this size
    stream = x.clone()
    _close(norm.add_and_norm(stream, delta), expected, dtype)
    assert torch.equal(stream, expected_stream)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 700])
def test_rope_rotates_q_and_k_in_place_like_apply_rotary(dtype: torch.dtype, tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    q = torch.randn(tokens, 9, 64, generator=generator).to(dtype)
    k = torch.randn(tokens, 3, 64, generator=generator).to(dtype)
    half = torch.randn(tokens, 32, generator=generator) * 50
    angles = torch.cat((half, half), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    got_q, got_k = q.clone(), k.clone()
    fused_ops.rope(got_q, got_k, cos, sin)
    _close(got_q, expected_q, dtype)
    _close(got_k, expected_k, dtype)
    via_model_code = rotary_qk(q.clone(), k.clone(), cos, sin)
    _close(via_model_code[0], expected_q, dtype)
    _close(via_model_code[1], expected_k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_the_torch_path(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    gate = (torch.randn(50, 1536, generator=generator) * 6).to(dtype)
    up = torch.randn(50, 1536, generator=generator).to(dtype)
    _close(fused_ops.silu_mul(gate, up), F.silu(gate) * up, dtype)


def test_bad_arguments_are_refused_before_any_c_runs() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="add_rms_norm kernel needs contiguous"):
        fused_ops.add_rms_norm(x, torch.randn(4, 7), torch.ones(8), 1e-5)  # delta of another shape
    with pytest.raises(ValueError, match="add_rms_norm kernel needs contiguous"):
        fused_ops.add_rms_norm(x.t(), None, torch.ones(4), 1e-5)  # strided x
    with pytest.raises(ValueError, match="weight in x's dtype"):
        fused_ops.add_rms_norm(x, None, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        fused_ops.add_rms_norm(x, None, torch.ones(9), 1e-5)  # a short weight would be read past its end
    with pytest.raises(ValueError, match="silu_mul kernel needs"):
        fused_ops.silu_mul(x, torch.randn(4, 8, dtype=torch.float64))
    q, k, cos = torch.randn(2, 3, 8), torch.randn(2, 1, 8), torch.randn(2, 8)
    with pytest.raises(ValueError, match="RoPE kernel needs"):
        fused_ops.rope(q, k, cos, torch.randn(2, 6))  # a short sin table
    with pytest.raises(ValueError, match="RoPE kernel needs"):
        fused_ops.rope(q, torch.randn(3, 1, 8), cos, cos)  # k of another token count
    with pytest.raises(ValueError, match="RoPE kernel needs"):
        fused_ops.rope(q.transpose(1, 2), k, cos, cos)  # heads not of unit stride


def _prefill_and_decode_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    from tests.model_helpers import PagedKV, Sequence, paged_step

    # The per-layer path at every step (what the kernels' tests compare): decode steps would
    # otherwise run in the whole-stack kernel (tests/test_native_decoder.py).
    model.use_decoder_kernel = False
    kv = PagedKV(model, num_pages=16, page_size=16)
    seq = Sequence()
    prefill = paged_step(model, kv, [(seq, list(range(5, 45)))], all_logits=True)[0]
    decodes = [paged_step(model, kv, [(seq, [token])])[0] for token in (7, 99, 3)]
    return [prefill, *decodes]


def test_the_model_gives_the_same_logits_with_the_kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model's prefill and decode logits with the fused kernels and with the torch
    path (the kernels turned off), through the paged forward."""
    loaded = load_model("demo", device="cpu")
    fused = _prefill_and_decode_logits(loaded.model)
    monkeypatch.setattr(fused_ops, "applies", lambda x: False)
    unfused = _prefill_and_decode_logits(loaded.model)
    for got, expected in zip(fused, unfused, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_the_layers_call_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fused entry point is reached from the model code (a kernel left unwired would
    pass the comparisons above while the model kept its many torch ops). silu_mul runs where
    the linear kernel does not (it applies silu(gate) * up itself: tests/test_native_linear.py),
    so that one is turned off here."""
    from radixserve.native import linear as linear_kernel

    monkeypatch.setattr(linear_kernel, "applies", lambda x, weight: False)
    calls: dict[str, int] = {"add_rms_norm": 0, "rope": 0, "silu_mul": 0}
    for name in calls:
        original = getattr(fused_ops, name)

        def counted(*args, _name=name, _original=original):  # noqa: ANN002, ANN202
            calls[_name] += 1
            return _original(*args)
        monkeypatch.setattr(fused_ops, name, counted)
    loaded = load_model("demo", device="cpu")
    _prefill_and_decode_logits(loaded.model)
    layers_count = loaded.model.num_layers
    assert calls["rope"] >= 2 * layers_count and calls["silu_mul"] >= 2 * layers_count
    assert calls["add_rms_norm"] >= 2 * (2 * layers_count + 1)
    assert layers.fused_ops is fused_ops and rope.fused_ops is fused_ops
