"""The CPU linear kernel: equal to a float64 reference up to float32 rounding at every shape
(tails of k, of the output features and of the row blocks), each row's result bit for bit the
same whatever rows share the call and however many threads run it, checked before any C runs,
and wired into the model, whose logits do not move when it is turned off."""

from __future__ import annotations

import os
import platform

import pytest
import torch
import torch.nn.functional as F

from radixserve.models import layers
from radixserve.models.loader import load_model
from radixserve.native import linear as linear_kernel
from tests.test_native_fused import _prefill_and_decode_logits


def _operands(rows: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator),
            torch.randn(n, generator=generator))


def test_the_kernel_builds_on_this_machine() -> None:
    assert linear_kernel.library() is not None, linear_kernel.unavailable_reason()


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())


@pytest.mark.skipif(platform.machine() != "x86_64" or not os.path.exists("/proc/cpuinfo"), reason="x86 Linux")
def test_the_build_takes_the_widest_vectors_the_cpu_has() -> None:
    """AVX-512 takes 16 floats, AVX2 with FMA 8 (a CPU with AVX2 alone once ran the portable
    loops: 20 times slower than these, and than torch's BLAS); the model uses the kernel then."""
    flags = _cpu_flags()
    expected = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 0
    assert linear_kernel.library().radixserve_linear_vector_width() == expected
    assert linear_kernel.vectorised() == (expected > 0)


# k: whole vectors of 16 (a single row: of 32 too, then 16) and a masked tail (AVX2: of 8 and
# a tail); n: whole tiles of 4 and a tail; rows: 1 and 2 (one weight row at a time), 3..4 (one
# pass of tiles; AVX2: blocks of 2), 5..9 (a tail of rows), 66 and 130 (row blocks of 64, the
# last of 2 rows).
@pytest.mark.parametrize(("k", "n"), [(576, 1536), (37, 10), (53, 7), (16, 3), (1, 9), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 66, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_equals_a_float64_reference(k: int, n: int, rows: int, with_bias: bool) -> None:
    x, weight, bias = _operands(rows, k, n, seed=rows * 1000 + k + n)
    bias_or_none = bias if with_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias_or_none is None else bias_or_none.double())
    got = linear_kernel.linear(x, weight, bias_or_none)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # a float32 dot product of k terms of size ~1: error ~ sqrt(k) * 2^-24 * |terms|
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * k**0.5, rtol=1e-6)


@pytest.mark.parametrize(("k", "n"), [(576, 1536), (37, 10), (53, 7), (64, 5)])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_equals_a_float64_reference_rounded_once(k: int, n: int, rows: int) -> None:
    """bfloat16 in and out: the float32 sum of exact products, plus the bias, rounded once."""
    x, weight, bias = (t.bfloat16() for t in _operands(rows, k, n, seed=rows + k + n))
    expected = F.linear(x.double(), weight.double(), bias.double())
    got = linear_kernel.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # one bfloat16 rounding of the result (2^-8 relative) on top of a float32 sum's error
    torch.testing.assert_close(got.double(), expected, atol=1e-5 * k**0.5, rtol=2**-8)
    assert linear_kernel.applies(x[:1], weight) and not linear_kernel.applies(
        torch.zeros(linear_kernel.BF16_MAX_ROWS + 1, k, dtype=torch.bfloat16), weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 565])
def test_a_row_is_the_same_alone_among_others_and_on_any_thread_count(dtype: torch.dtype, k: int) -> None:
    """Batch invariance: each output is one fixed sum, whatever shares the call (a decode
    row alone, streamed one weight row at a time, or in a batch of 70, a prefill's row block
    in tiles) and however the outputs are split between threads. k = 565: tails of 16 and 32."""
    x, weight, bias = (t.to(dtype) for t in _operands(70, k, 1539, seed=5))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        together = linear_kernel.linear(x, weight, bias)
        torch.set_num_threads(1)
        one_thread = linear_kernel.linear(x, weight, bias)
        alone = [linear_kernel.linear(x[i : i + 1], weight, bias) for i in (0, 3, 4, 63, 64, 69)]
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, one_thread)
    for i, row in zip((0, 3, 4, 63, 64, 69), alone, strict=True):
        assert torch.equal(row[0], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6])
def test_several_weights_in_one_call_equal_one_call_each(dtype: torch.dtype, rows: int) -> None:
    """q, k and v's shapes (and an odd one), with and without biases: bit for bit the outputs
    of separate calls (each output is the same sum), whichever thread computes it."""
    x = _operands(rows, 576, 1, seed=rows)[0].to(dtype)
    shapes = [576, 192, 192, 7]
    weights = [_operands(1, 576, n, seed=n)[1].to(dtype) for n in shapes]
    biases = [None, _operands(1, 576, 192, seed=9)[2].to(dtype), None, torch.randn(7).to(dtype)]
    together = linear_kernel.linear_many(x, weights, biases)
    for got, weight, bias in zip(together, weights, biases, strict=True):
        assert got.shape == (rows, weight.shape[0]) and got.dtype == dtype
        assert torch.equal(got, linear_kernel.linear(x, weight, bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n"), [(1, 1536), (2, 1536), (5, 1536), (3, 7), (66, 9), (70, 9)])
def test_the_gated_form_equals_silu_of_gate_times_up(dtype: torch.dtype, rows: int, n: int) -> None:
    """silu(x g^T + bg) * (x u^T + bu) against the separate kernels and fused_ops.silu_mul, which
    round where torch rounds: bit for bit in bfloat16, to rounding in float32."""
    from radixserve.native import fused_ops

    x, gate, gate_bias = (t.to(dtype) for t in _operands(rows, 576, n, seed=rows + n))
    _, up, up_bias = (t.to(dtype) for t in _operands(rows, 576, n, seed=rows + n + 1))
    for biases in ((None, None), (gate_bias, up_bias)):
        got = linear_kernel.gated_linear(x, gate, up, *biases)
        separate = fused_ops.silu_mul(linear_kernel.linear(x, gate, biases[0]), linear_kernel.linear(x, up, biases[1]))
        if dtype == torch.bfloat16:
            assert torch.equal(got, separate)
        else:
            torch.testing.assert_close(got, separate, atol=1e-5, rtol=1e-5)
        reference = F.silu(F.linear(x.double(), gate.double(), None if biases[0] is None else biases[0].double()))
        reference = reference * F.linear(x.double(), up.double(), None if biases[1] is None else biases[1].double())
        torch.testing.assert_close(got.double(), reference, atol=1e-3, rtol=2**-5 if dtype == torch.bfloat16 else 1e-5)  # bf16: four roundings


def test_bad_arguments_are_refused_before_any_c_runs() -> None:
    x, weight, bias = _operands(4, 8, 6, seed=1)
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.linear(x, torch.randn(6, 7))  # weight of another width would be read past its end
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.linear(x, weight, torch.randn(5))  # a short bias
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.linear(x, weight.t().contiguous().t())  # strided weight
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.linear(x.double(), weight)
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.linear(x.bfloat16(), weight)  # mixed dtypes
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.linear_many(x, [weight, torch.randn(3, 9)], [None, None])  # the second too wide
    with pytest.raises(ValueError, match="1 to 8 weights"):
        linear_kernel.linear_many(x, [weight] * 9, [None] * 9)  # more than the C side holds
    with pytest.raises(ValueError, match="one shape"):
        linear_kernel.gated_linear(x, weight, torch.randn(5, 8))
    with pytest.raises(ValueError, match="linear kernel needs"):
        linear_kernel.gated_linear(x, weight, weight, None, torch.randn(2))
    # a strided x is made contiguous, not refused
    torch.testing.assert_close(linear_kernel.linear(x.t().contiguous().t(), weight), F.linear(x, weight))
    assert not linear_kernel.applies(x.bfloat16(), weight) and not linear_kernel.applies(x, weight.double())
    assert not linear_kernel.applies(x.half(), weight.half())


def test_the_model_gives_the_same_logits_with_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo model's prefill and decode logits with the kernel and with F.linear."""
    loaded = load_model("demo", device="cpu")
    calls = 0
    counts = {"linear_many": 0, "gated_linear": 0}
    original = linear_kernel.linear

    def counted(*args: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(*args)

    for name in counts:
        def counted_fused(*args, _name=name, _original=getattr(linear_kernel, name)):  # noqa: ANN002, ANN202
            counts[_name] += 1
            return _original(*args)
        monkeypatch.setattr(linear_kernel, name, counted_fused)
    monkeypatch.setattr(linear_kernel, "linear", counted)
    with_kernel = _prefill_and_decode_logits(loaded.model)
    assert counts == {"linear_many": 4 * loaded.model.num_layers, "gated_linear": 4 * loaded.model.num_layers}
    # o and down of every layer and the LM head, each step (q, k, v and gate, up go through
    # linear_many and gated_linear, counted below)
    assert calls == 4 * (2 * loaded.model.num_layers + 1)
    monkeypatch.setattr(linear_kernel, "applies", lambda x, weight: False)
    without = _prefill_and_decode_logits(loaded.model)
    for got, expected in zip(with_kernel, without, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert layers.linear_kernel is linear_kernel
