"""The built-in demo model: a small Llama with RANDOM weights and a tokenizer trained offline.

Its output is fluent-looking nonsense: the weights come from a fixed seed, not from training.
It exists so that radixserve runs, serves and benchmarks anywhere without a download: a
4-layer Llama (hidden 256, 4 query / 2 KV heads, tied embeddings, 4096 positions) and a
byte-level BPE tokenizer trained with `tokenizers` on a short original text shipped in
radixserve/data, wrapped in a PreTrainedTokenizerFast with a ChatML chat template
(`<|im_start|>role\\n...<|im_end|>`, eos `<|im_end|>`).

It is written once, as an ordinary HF checkpoint directory, to $RADIXSERVE_CACHE/demo-v1
(default ~/.cache/radixserve/demo-v1), so the loader and transformers read it like any other.
Building is deterministic (same bytes every time) and takes about a second.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast

from radixserve.models.llama import CausalLM

DEMO_VERSION = "demo-v1"  # bump when the recipe below changes, so stale caches are not reused
DEMO_SEED = 20240611
DEMO_VOCAB_SIZE = 2048
CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "demo_corpus.txt"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> Path:
    """Where radixserve keeps built artefacts: $RADIXSERVE_CACHE or ~/.cache/radixserve."""
    return Path(os.environ.get("RADIXSERVE_CACHE") or Path.home() / ".cache" / "radixserve")


def demo_checkpoint_dir(root: Path | None = None) -> Path:
    """The demo checkpoint directory under `root` (default `cache_root()`), built if missing.

    Built in a temporary sibling directory and renamed into place, so concurrent callers and
    interrupted builds never leave a half-written checkpoint behind.
    """
    target = (root or cache_root()) / DEMO_VERSION
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_VERSION}-", dir=target.parent))
    try:
        write_demo_checkpoint(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not a concurrent builder's win
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def windowed_demo_dir(directory: Path, window: int | None, *, full_layers: int = 0) -> Path:
    """The demo's weights in `directory` as a sliding-window model (for tests and benchmarks):
    a Mistral with `window` on every layer (None: the same weights with full attention), or
    with `full_layers` > 0 a Qwen2 whose first `full_layers` layers attend to everything
    (`use_sliding_window`, `max_window_layers`; its q/k/v biases are zeros)."""
    shutil.copytree(demo_checkpoint_dir(), directory, dirs_exist_ok=True)
    config = json.loads((directory / "config.json").read_text())
    if full_layers:
        config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                      sliding_window=window, max_window_layers=full_layers)
        weights = load_file(directory / "model.safetensors")
        for name in [n for n in weights if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
            weights[name.replace(".weight", ".bias")] = torch.zeros(weights[name].shape[0], dtype=weights[name].dtype)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def write_demo_checkpoint(directory: Path) -> None:
    """Write the demo's config.json, model.safetensors and tokenizer files into `directory`."""
    tokenizer = build_tokenizer(DEMO_VOCAB_SIZE, max_length=4096)
    config = demo_config(tokenizer)
    config.save_pretrained(directory)
    save_file(random_weights(config, DEMO_SEED), str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_pretrained(directory)


def build_tokenizer(vocab_size: int, *, max_length: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with at most `vocab_size` tokens (256 bytes, the 3 ChatML
    specials, merges), trained on the demo corpus, with the ChatML chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=max_length,
    )


def demo_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The demo's architecture; its vocabulary is exactly the tokenizer's."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def random_weights(config: LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights for every parameter of `config`'s model, by HF name.

    Norm weights are 1, biases 0, linear weights N(0, 1/fan_in) (activations stay O(1)), and
    the (tied) embedding N(0, 0.125^2), which gives logits of a few units: peaked enough for
    greedy decoding to be stable, flat enough for sampling to vary.
    """
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in CausalLM(config).named_parameters()}
    generator = torch.Generator().manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            weights[name] = torch.zeros(shape)
        elif name == "model.embed_tokens.weight":
            weights[name] = torch.randn(shape, generator=generator) * 0.125
        else:
            weights[name] = torch.randn(shape, generator=generator) * shape[1] ** -0.5
    return weights
