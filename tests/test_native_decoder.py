"""The whole-stack decode kernel (native/decoder.c): on steps where every row decodes, the
model runs all its layers in one C call, and its logits are the per-layer path's bit for bit,
for every variant it takes (biases, tied embeddings, Llama 3 RoPE, sliding windows), over
pages handed out in shuffled order; steps with a prefill, and models it cannot take, keep the
per-layer path; everything C would misread is refused before C runs."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from radixserve.attention.torch_backend import TorchBackend
from radixserve.models import llama as llama_module
from radixserve.models.decoder_kernel import decoder_weights, layer_rows
from radixserve.models.loader import load_model
from radixserve.native import decoder
from radixserve.native import linear as linear_kernel
from tests.model_helpers import PagedKV, Sequence, paged_step, write_tiny_checkpoint

PAGE_SIZE = 4
# Three prompts of different lengths (a page boundary inside each), then decode steps.
PROMPTS = [[5 + i % 40 for i in range(n)] for n in (7, 13, 2)]
DECODE_STEPS = 11


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoder")
    names = ["llama", "llama3_rope", "llama_tied_bias", "mistral", "qwen2", "qwen3"]
    paths = {name: write_tiny_checkpoint(name, root / name) for name in names}
    for name in ("mistral_window", "qwen2_window"):
        paths[name] = write_tiny_checkpoint(name, root / name, window=6)
    return paths


@contextmanager
def kernel_calls(model: llama_module.CausalLM, use_kernel: bool) -> Iterator[list[int]]:
    """The model with the kernel on or off; yields a one-item list: the kernel's call count."""
    model.use_decoder_kernel = use_kernel
    calls = [0]
    original = llama_module.run_layers

    def counted(*args: object, **kwargs: object) -> torch.Tensor | None:
        calls[0] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    llama_module.run_layers = counted  # type: ignore[assignment]
    try:
        yield calls
    finally:
        llama_module.run_layers = original  # type: ignore[assignment]
        model.use_decoder_kernel = True


def _run(model: llama_module.CausalLM, use_kernel: bool) -> tuple[list[torch.Tensor], int]:
    """Prefill three prompts, then decode them together (the third one joining late: a step
    that mixes a prefill with decodes); every step's logits, and the kernel's call count."""
    with kernel_calls(model, use_kernel) as calls:
        kv = PagedKV(model, num_pages=64, page_size=PAGE_SIZE, seed=3)
        seqs = [Sequence() for _ in PROMPTS]
        logits = paged_step(model, kv, [(seqs[0], PROMPTS[0]), (seqs[1], PROMPTS[1])])
        history = list(logits)
        last = [int(x.argmax()) for x in logits]
        # the third prompt's prefill beside two decodes: the per-layer path
        step = paged_step(model, kv, [(seqs[0], [last[0]]), (seqs[1], [last[1]]), (seqs[2], PROMPTS[2])])
        history += step
        last = [int(x.argmax()) for x in step]
        for _ in range(DECODE_STEPS):
            step = paged_step(model, kv, [(seq, [token]) for seq, token in zip(seqs, last, strict=True)])
            history += step
            last = [int(x.argmax()) for x in step]
    return history, calls[0]


def test_the_kernel_builds_on_this_machine() -> None:
    assert decoder.library() is not None, decoder.unavailable_reason()


@pytest.mark.parametrize("name", ["llama", "llama3_rope", "llama_tied_bias", "mistral", "qwen2",
                                  "mistral_window", "qwen2_window"])
def test_decode_steps_equal_the_per_layer_path_bit_for_bit(checkpoints: dict[str, Path], name: str) -> None:
    model = load_model(str(checkpoints[name]), device="cpu", dtype=torch.float32).model
    with_kernel, calls = _run(model, use_kernel=True)
    without, no_calls = _run(model, use_kernel=False)
    assert (calls, no_calls) == (DECODE_STEPS, 0)  # every all-decode step, and only those
    for got, expected in zip(with_kernel, without, strict=True):
        assert torch.equal(got, expected)
        assert torch.isfinite(got).all()  # NaN-filled pages: a wrong slot read would show


def test_models_it_cannot_take_keep_the_per_layer_path(checkpoints: dict[str, Path]) -> None:
    """Qwen3 normalises q and k per head (no such step in C)."""
    qwen3 = load_model(str(checkpoints["qwen3"]), device="cpu", dtype=torch.float32).model
    assert decoder_weights(qwen3) is None
    _, calls = _run(qwen3, use_kernel=True)
    assert calls == 0


def _run_one_stream(model: llama_module.CausalLM, use_kernel: bool) -> tuple[list[torch.Tensor], int]:
    """One prompt's prefill, then DECODE_STEPS decode steps of its one row."""
    with kernel_calls(model, use_kernel) as calls:
        kv = PagedKV(model, num_pages=32, page_size=PAGE_SIZE, seed=2)
        seq = Sequence()
        history = paged_step(model, kv, [(seq, PROMPTS[1])])
        for _ in range(DECODE_STEPS):
            history += paged_step(model, kv, [(seq, [int(history[-1].argmax())])])
    return history, calls[0]


@pytest.mark.parametrize("name", ["llama", "llama_tied_bias", "qwen2", "mistral_window"])
def test_bfloat16_decodes_equal_the_per_layer_path_bit_for_bit(checkpoints: dict[str, Path], name: str) -> None:
    """bfloat16 up to linear.BF16_MAX_ROWS rows (where the per-layer path's projections are the
    linear kernel's too): every rounding in the same place, one stream and three; past those
    rows the per-layer path (torch's GEMM)."""
    model = load_model(str(checkpoints[name]), device="cpu", dtype=torch.bfloat16).model
    for run in (_run_one_stream, _run):
        with_kernel, calls = run(model, use_kernel=True)
        without, no_calls = run(model, use_kernel=False)
        assert (calls, no_calls) == (DECODE_STEPS, 0)
        for got, expected in zip(with_kernel, without, strict=True):
            assert torch.equal(got, expected)
            assert torch.isfinite(got).all()
    weights = decoder_weights(model)
    assert weights is not None
    too_many = torch.zeros(linear_kernel.BF16_MAX_ROWS + 1, model.config.hidden_size, dtype=torch.bfloat16)
    assert layer_rows(model, TorchBackend(), too_many, weights) is None


def _one_decode_step(model: llama_module.CausalLM) -> dict[str, object]:
    """The arguments `run_layers` gets on a decode step of one sequence."""
    captured: dict[str, object] = {}
    original = llama_module.run_layers

    def capture(x, cos, sin, slots, weights, k_caches, v_caches, rows, **kwargs) -> torch.Tensor | None:
        captured.update(x=x.clone(), cos=cos, sin=sin, slots=slots, weights=weights, k_caches=k_caches,
                        v_caches=v_caches, rows=rows)
        return original(x, cos, sin, slots, weights, k_caches, v_caches, rows, **kwargs)

    kv = PagedKV(model, num_pages=16, page_size=PAGE_SIZE, seed=1)
    seq = Sequence()
    paged_step(model, kv, [(seq, PROMPTS[0])])
    llama_module.run_layers = capture  # type: ignore[assignment]
    try:
        paged_step(model, kv, [(seq, [7])])
    finally:
        llama_module.run_layers = original  # type: ignore[assignment]
    return captured


def test_bad_arguments_are_refused_before_any_c_runs(checkpoints: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(str(checkpoints["llama"]), device="cpu", dtype=torch.float32).model
    args = _one_decode_step(model)
    assert args, "the decode step did not reach the kernel"
    c_calls = 0
    real_library = decoder.library()

    class Guard:
        """The library, counting the kernel's calls."""

        def __getattr__(self, name: str) -> object:
            function = getattr(real_library, name)

            def called(*a: object) -> None:
                nonlocal c_calls
                c_calls += 1
                function(*a)
            return called

    monkeypatch.setattr(decoder, "library", lambda: Guard())

    def call(**changes: object) -> None:
        merged = dict(args, **changes)
        x = merged["x"] if "x" in changes else merged["x"].clone()  # the step's own x is reused
        decoder.run_layers(x, merged["cos"], merged["sin"], merged["slots"], merged["weights"],
                           merged["k_caches"], merged["v_caches"], merged["rows"])

    call()  # the captured step itself passes
    assert c_calls == 1
    slots = args["slots"]
    k_caches = args["k_caches"]
    pool_slots = k_caches[0].shape[0] * k_caches[0].shape[1]
    bad = {
        "slot past the pool": {"slots": torch.full_like(slots, pool_slots)},
        "negative slot": {"slots": torch.full_like(slots, -1)},
        "int32 slots": {"slots": slots.to(torch.int32)},
        "x of the wrong width": {"x": torch.zeros(1, args["x"].shape[1] + 1)},
        "strided x": {"x": torch.zeros(1, 2 * args["x"].shape[1])[:, ::2]},
        "bfloat16 x": {"x": args["x"].to(torch.bfloat16)},
        "short cos": {"cos": args["cos"][:, :-2].contiguous()},
        "a cache missing": {"k_caches": list(k_caches)[:-1]},
        "a cache of another shape": {"k_caches": [*list(k_caches)[:-1], torch.zeros(4, PAGE_SIZE, 1, 1)]},
        "a row set missing": {"rows": list(args["rows"])[:-1]},
        "two tokens for one row": {"x": args["x"].repeat(2, 1), "cos": args["cos"].repeat(2, 1),
                                       "sin": args["sin"].repeat(2, 1), "slots": slots.repeat(2)},
    }
    for what, change in bad.items():
        with pytest.raises(ValueError):
            call(**change)
        assert c_calls == 1, what
    small_pool = [c[:1] for c in k_caches]  # rows read pages past a one-page pool
    with pytest.raises(ValueError, match="past the pool|slot"):
        call(k_caches=small_pool, v_caches=small_pool)
    assert c_calls == 1


def test_weights_of_the_wrong_kind_are_refused_when_the_view_is_built(checkpoints: dict[str, Path]) -> None:
    model = load_model(str(checkpoints["llama"]), device="cpu", dtype=torch.float32).model
    weights = decoder_weights(model)
    assert weights is not None
    layer = model.model.layers[0]
    tensors = {"input_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight}
    for name in ("q", "k", "v", "o"):
        tensors[name] = getattr(layer.self_attn, f"{name}_proj").weight
    for name in ("gate", "up", "down"):
        tensors[name] = getattr(layer.mlp, f"{name}_proj").weight
    decoder.DecoderWeights([tensors], weights.shape)  # as the model has it
    for name, wrong in (("q", tensors["q"].t()), ("down", tensors["down"][:, :-1]),
                        ("up", tensors["up"].double()), ("gate", None)):
        with pytest.raises(ValueError, match=name):
            decoder.DecoderWeights([dict(tensors, **{name: wrong})], weights.shape)
    with pytest.raises(ValueError, match="bias"):
        decoder.DecoderWeights([dict(tensors, o_bias=torch.zeros(3))], weights.shape)
    assert ctypes.sizeof(decoder._RowSet) == 7 * 8  # the C struct: five pointers, two int64


def test_caches_are_checked_once_per_set_of_tensors(checkpoints: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's caches are checked on their first call and again whenever other tensors come
    (a freed cache's address reused by a new tensor included: weak references)."""
    model = load_model(str(checkpoints["llama"]), device="cpu", dtype=torch.float32).model
    weights = decoder_weights(model)
    assert weights is not None
    checked = []
    real_check = decoder._check_caches
    monkeypatch.setattr(decoder, "_check_caches", lambda *a: checked.append(1) or real_check(*a))
    shape = (3, PAGE_SIZE, weights.shape.kv_heads, weights.shape.head_dim)
    k = [torch.zeros(shape) for _ in range(weights.num_layers)]
    v = [torch.zeros(shape) for _ in range(weights.num_layers)]
    first = weights.bind_caches(k, v)
    assert first[1:] == (3, PAGE_SIZE) and len(checked) == 1
    assert weights.bind_caches(list(k), list(v))[1:] == (3, PAGE_SIZE) and len(checked) == 1  # the same tensors
    assert k[0].data_ptr() in list(first[0]) and v[-1].data_ptr() in list(first[0])
    k[0] = torch.zeros(shape)  # one new tensor: checked again, its address bound
    pointers, _, _ = weights.bind_caches(k, v)
    assert len(checked) == 2 and k[0].data_ptr() in list(pointers)
    del k[0]
    with pytest.raises(ValueError):
        weights.bind_caches(k, v)  # one cache short
    k.insert(0, torch.zeros(5, PAGE_SIZE, 1, 1))
    with pytest.raises(ValueError):
        weights.bind_caches(k, v)
