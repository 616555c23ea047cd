"""The built-in demo model: deterministic offline build, tokenizer, chat template, parity."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from radixserve.models import load_model
from radixserve.models.demo import DEMO_VERSION, demo_checkpoint_dir
from tests.model_helpers import (
    PagedKV,
    Sequence,
    load_reference,
    paged_greedy,
    paged_step,
    reference_logits,
)


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    demo_checkpoint_dir(root)
    assert time.perf_counter() - start < 10.0, "building the demo must take seconds"
    return root


def test_demo_is_a_complete_checkpoint(demo_root: Path) -> None:
    directory = demo_root / DEMO_VERSION
    names = {p.name for p in directory.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [p for p in demo_root.iterdir() if p.name != DEMO_VERSION], "staging dir left behind"


def test_demo_build_is_deterministic(demo_root: Path, tmp_path: Path) -> None:
    again = demo_checkpoint_dir(tmp_path)
    first = demo_root / DEMO_VERSION
    for path in sorted(first.iterdir()):
        assert path.read_bytes() == (again / path.name).read_bytes(), path.name
    assert {p.name for p in first.iterdir()} == {p.name for p in again.iterdir()}


def test_existing_demo_is_reused(demo_root: Path) -> None:
    weights = demo_root / DEMO_VERSION / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert demo_checkpoint_dir(demo_root) == demo_root / DEMO_VERSION
    assert weights.stat().st_mtime_ns == stamp


@pytest.mark.parametrize(
    "text",
    [
        "The river town of Alder Bend woke slowly.",
        "naïve café, Straße, smörgåsbord",
        "こんにちは世界 — 你好 — Привет — مرحبا",
        "emoji 🙂🚀👩‍👩‍👧‍👦 and flags 🇫🇷 ✨",
        "  leading spaces,\ttabs\nand new lines\n",
        "",
    ],
)
def test_tokenizer_round_trips_text(demo_root: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_root / DEMO_VERSION)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_chat_template_is_chatml(demo_root: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_root / DEMO_VERSION)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi 🙂<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end


def test_demo_loads_and_matches_transformers(demo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(demo_root))
    demo = load_model("demo", device="cpu")
    assert demo.name == "demo" and demo.max_context_len == 4096
    assert demo.tokenizer.eos_token_id == demo.config.eos_token_id
    model = demo.model
    assert (model.num_layers, model.num_qo_heads, model.num_kv_heads, model.head_dim) == (4, 4, 2, 64)
    assert model.vocab_size == len(demo.tokenizer) == 2048 and model.lm_head is None

    reference = load_reference(demo_root / DEMO_VERSION)
    prompt = demo.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the library in Alder Bend."}],
        tokenize=True, add_generation_prompt=True,
    )["input_ids"]
    (logits,) = paged_step(model, PagedKV(model, 16, 16), [(Sequence(), prompt)], all_logits=True)
    torch.testing.assert_close(logits, reference_logits(reference, prompt), atol=1e-4, rtol=0)

    expected = reference.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=16, do_sample=False,
    )[0, len(prompt):].tolist()
    assert paged_greedy(model, prompt, 16, page_size=16) == expected
