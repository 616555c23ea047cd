"""CausalLM over paged KV against transformers, on tiny random checkpoints of each family."""

from __future__ import annotations

import json
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tests.model_helpers import (
    TINY_MODEL_NAMES,
    PagedKV,
    Sequence,
    load_reference,
    paged_greedy,
    paged_step,
    reference_logits,
)
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.models import LoadedModel, load_model, verify_cached_kv
from radixserve.models.llama import layer_windows
from radixserve.models.loader import max_context_len
from radixserve.models.rope import RotaryEmbedding, inverse_frequencies, rope_settings

ATOL = 1e-4

Models = Callable[[str], tuple[LoadedModel, torch.nn.Module]]


@pytest.fixture(scope="session")
def models(tiny_checkpoints: dict[str, Path]) -> Models:
    """name -> (our loaded model, the transformers reference), each loaded once."""
    cache: dict[str, tuple[LoadedModel, torch.nn.Module]] = {}

    def get(name: str) -> tuple[LoadedModel, torch.nn.Module]:
        if name not in cache:
            directory = tiny_checkpoints[name]
            cache[name] = (load_model(str(directory), device="cpu"), load_reference(directory))
        return cache[name]

    return get


def random_tokens(seed: int, n: int, vocab: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("name", TINY_MODEL_NAMES)
def test_prefill_logits_match_transformers(models: Models, name: str, page_size: int) -> None:
    ours, reference = models(name)
    prompt = random_tokens(page_size, 37)
    kv = PagedKV(ours.model, num_pages=40, page_size=page_size, seed=page_size)
    (logits,) = paged_step(ours.model, kv, [(Sequence(), prompt)], all_logits=True)
    assert logits.dtype == torch.float32 and logits.shape == (37, ours.model.vocab_size)
    torch.testing.assert_close(logits, reference_logits(reference, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("name", "page_size"), [(name, 4) for name in TINY_MODEL_NAMES] + [("llama", 1), ("qwen3", 16)]
)
def test_greedy_generation_matches_transformers(models: Models, name: str, page_size: int) -> None:
    ours, reference = models(name)
    prompt = random_tokens(1, 11)
    expected = reference.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=32, do_sample=False,
    )[0, len(prompt):].tolist()
    assert len(expected) == 32
    assert paged_greedy(ours.model, prompt, 32, page_size) == expected


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_one_forward_mixing_prefill_chunk_and_decode(models: Models, name: str) -> None:
    """Step 2 holds a decode, a fresh prefill, a prefill continuation, an idle sequence and
    another decode; every token's logits equal a fresh full-sequence computation."""
    ours, reference = models(name)
    kv = PagedKV(ours.model, num_pages=64, page_size=4, seed=3)
    lengths = {"decode_a": 21, "prefill": 15, "chunked": 18, "idle": 6, "decode_b": 10}
    full = {key: random_tokens(seed, n) for seed, (key, n) in enumerate(lengths.items())}
    seqs = {key: Sequence() for key in full}
    first_step = {"decode_a": 20, "chunked": 11, "idle": 6, "decode_b": 9}
    paged_step(ours.model, kv, [(seqs[k], full[k][:n]) for k, n in first_step.items()])

    second_step = [(key, full[key][first_step.get(key, 0):]) for key in full]
    logits = paged_step(
        ours.model, kv, [(seqs[k], new) for k, new in second_step], all_logits=True
    )
    for (key, new), got in zip(second_step, logits):
        expected = reference_logits(reference, full[key])[len(full[key]) - len(new):]
        assert got.shape == expected.shape, key
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=key)


@pytest.mark.parametrize("page_size", [4, 16])
def test_cache_hit_reads_pages_written_by_an_earlier_sequence(models: Models, page_size: int) -> None:
    ours, reference = models("llama3_rope")
    kv = PagedKV(ours.model, num_pages=64, page_size=page_size, seed=5)
    shared_prefix = random_tokens(10, 35)
    first_prompt = shared_prefix + random_tokens(11, 6)
    second_prompt = shared_prefix + random_tokens(12, 9)
    first = Sequence()
    paged_step(ours.model, kv, [(first, first_prompt)])

    full_pages = len(shared_prefix) // page_size
    shared = first.block_table[:full_pages]
    before = [cache[shared].clone() for cache in kv.k + kv.v]
    second = Sequence(block_table=list(shared), num_cached=full_pages * page_size)
    (logits,) = paged_step(ours.model, kv, [(second, second_prompt[second.num_cached:])],
                           all_logits=True)

    expected = reference_logits(reference, second_prompt)[full_pages * page_size:]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    for cache, old in zip(kv.k + kv.v, before):
        assert torch.equal(cache[shared], old), "shared pages must never be written"


def test_verify_cached_kv_finds_the_corrupted_page(models: Models) -> None:
    ours, _ = models("qwen3")
    page_size = 4
    kv = PagedKV(ours.model, num_pages=16, page_size=page_size, seed=9)
    tokens = random_tokens(20, 23)
    seq = Sequence()
    # Written by a different schedule than the check's single prefill: chunk, then decodes.
    paged_step(ours.model, kv, [(seq, tokens[:15])])
    for token in tokens[15:]:
        paged_step(ours.model, kv, [(seq, [token])])
    pages = seq.block_table

    def check(prefix: list[int] = tokens) -> int | None:
        return verify_cached_kv(ours.model, kv.k, kv.v, prefix, pages, page_size)

    assert check() is None

    pristine = [cache.clone() for cache in kv.k + kv.v]

    def restore() -> None:
        for cache, original in zip(kv.k + kv.v, pristine):
            cache.copy_(original)

    kv.k[1][pages[3], 2, 0, 5] += 0.01
    assert check() == 3
    restore()
    kv.v[0][pages[0], 0] = 0.0
    kv.v[1][pages[4], 0] = 0.0
    assert check() == 0
    restore()
    kv.k[0][pages[4], 1, 1, 0] = float("nan")
    assert check() == 4
    restore()
    assert check() is None

    fresh = Sequence()
    paged_step(ours.model, kv, [(fresh, tokens)])
    pages = fresh.block_table
    kv.k[0][pages[5], 3] = float("nan")  # past the 23rd token: not part of the prefix
    assert check() is None
    assert check(tokens[:9] + [tokens[9] + 1] + tokens[10:]) == 2  # token 9 sits in page 2


def test_loaded_model_describes_itself(models: Models, tiny_checkpoints: dict[str, Path]) -> None:
    ours, _ = models("qwen3")
    assert ours.name == str(tiny_checkpoints["qwen3"])
    assert ours.max_context_len == 512
    assert ours.dtype == torch.float32 and ours.device == torch.device("cpu")
    assert (ours.model.num_layers, ours.model.num_kv_heads, ours.model.head_dim) == (2, 2, 32)
    assert ours.model.vocab_size == ours.config.vocab_size == len(ours.tokenizer)
    assert ours.tokenizer.eos_token == "<|im_end|>"
    assert all(not p.requires_grad for p in ours.model.parameters())


def test_bfloat16_model_tracks_float32(models: Models, tiny_checkpoints: dict[str, Path]) -> None:
    ours, _ = models("llama")
    half = load_model(str(tiny_checkpoints["llama"]), dtype="bfloat16", device="cpu")
    assert half.dtype == torch.bfloat16
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
    prompt = random_tokens(2, 20)
    (exact,) = paged_step(ours.model, PagedKV(ours.model, 8, 4), [(Sequence(), prompt)])
    (approx,) = paged_step(half.model, PagedKV(half.model, 8, 4), [(Sequence(), prompt)])
    assert approx.dtype == torch.float32
    assert (approx - exact).abs().max() < 0.1 * exact.abs().max()


def test_sharded_checkpoint_loads_the_same_weights(
    models: Models, tiny_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    source = tiny_checkpoints["qwen2"]
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(source).save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, sharded / name)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = load_model(str(sharded), device="cpu")
    original, _ = models("qwen2")
    for (name, a), (_, b) in zip(original.model.state_dict().items(),
                                 reloaded.model.state_dict().items()):
        assert torch.equal(a, b), name


def test_missing_files_are_named(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="model not found: .*nowhere.* is no checkpoint directory"):
        load_model(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    shutil.copy(tiny_checkpoints["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_model(str(tmp_path), device="cpu")
    shutil.copy(tiny_checkpoints["llama"] / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="weight file not found: .*model.safetensors"):
        load_model(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(str(tiny_checkpoints["llama"]), dtype="int8", device="cpu")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": 1}
    ))
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(tmp_path), device="cpu")


def test_a_sliding_window_does_not_cap_the_context() -> None:
    assert max_context_len(MistralConfig(max_position_embeddings=4096, sliding_window=1024)) == 4096
    assert max_context_len(MistralConfig(max_position_embeddings=4096, sliding_window=None)) == 4096


def test_layer_windows_follow_transformers_layer_types() -> None:
    """Which layers are windowed, as transformers 5 decides (Qwen2/Qwen3: layers from
    max_window_layers on, only with use_sliding_window; Mistral: all; Llama: none)."""
    common = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert layer_windows(MistralConfig(**common, sliding_window=32)) == [32] * 4
    assert layer_windows(MistralConfig(**common, sliding_window=None)) == [None] * 4
    assert layer_windows(LlamaConfig(**common)) == [None] * 4
    for cls in (Qwen2Config, Qwen3Config):
        mixed = cls(**common, use_sliding_window=True, sliding_window=32, max_window_layers=1)
        assert mixed.layer_types == ["full_attention"] + ["sliding_attention"] * 3  # transformers' own
        assert layer_windows(mixed) == [None, 32, 32, 32]
        assert layer_windows(cls(**common, use_sliding_window=False, sliding_window=32)) == [None] * 4
        assert layer_windows(cls(**common, use_sliding_window=True, sliding_window=32,
                                 max_window_layers=0)) == [32] * 4
    # A config without layer_types (written by transformers 4) gets the same answer.
    legacy = Qwen2Config(**common, use_sliding_window=True, sliding_window=32, max_window_layers=2)
    del legacy.layer_types
    assert layer_windows(legacy) == [None, None, 32, 32]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64, "rope_theta": 500000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "default", "rope_theta": 1000.0},
    ],
)
def test_rope_frequencies_equal_transformers(rope: dict[str, float | str]) -> None:
    config = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=dict(rope))
    ours = inverse_frequencies(config, 64)
    if rope["rope_type"] == "default":
        theirs = 1.0 / (1000.0 ** (torch.arange(0, 64, 2).float() / 64))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[str(rope["rope_type"])](config)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_equal_the_computed_ones(dtype: torch.dtype) -> None:
    """The CPU table gives each position's cos/sin with the bits computing them gives, as it
    grows, and positions past it are computed."""
    rotary = RotaryEmbedding(1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))
    generator = torch.Generator().manual_seed(0)
    cases = [torch.tensor([0]), torch.tensor([1023]), torch.tensor([1024, 5, 2047]), torch.arange(3000, 3517),
             torch.randint(0, RotaryEmbedding.TABLE_POSITIONS, (777,), generator=generator),
             torch.tensor([RotaryEmbedding.TABLE_POSITIONS - 1, RotaryEmbedding.TABLE_POSITIONS, 100_000])]
    sizes = []
    for positions in cases:
        cos, sin = rotary(positions, dtype)
        want_cos, want_sin = rotary._compute(positions, dtype)
        assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        sizes.append(len(rotary._tables[dtype][0]))
    assert sizes[:4] == [1024, 1024, 2048, 4096]  # doubling, or to the position asked for
    assert int(cases[4].max()) < sizes[4] <= RotaryEmbedding.TABLE_POSITIONS and sizes[5] == sizes[4]
    angles = torch.tensor([[1023.0]]) * rotary._inv_freq_by_device[torch.device("cpu")]
    assert torch.equal(rotary(torch.tensor([1023]), dtype)[0], torch.cat((angles, angles), -1).cos().to(dtype))


def test_rope_settings_read_transformers_4_attributes() -> None:
    old_style = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    settings = rope_settings(old_style)  # type: ignore[arg-type]
    assert settings["rope_type"] == "linear" and settings["rope_theta"] == 5e5
    bare = SimpleNamespace(rope_theta=None)
    assert rope_settings(bare)["rope_theta"] == 1e4  # type: ignore[arg-type]
    second_frequency = float(inverse_frequencies(old_style, 8)[1])  # type: ignore[arg-type]
    assert math.isclose(second_frequency, 5e5**-0.25 / 2, rel_tol=1e-6)
