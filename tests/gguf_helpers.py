"""Test helpers: tiny HF checkpoints written as llama.cpp GGUF files, and transformers' reading.

`write_gguf` does what llama.cpp's convert_hf_to_gguf.py does for the Llama family, written
independently of radixserve's reader: its metadata keys, tensor names, the q/k row permutation
of the "llama" architecture, norms and biases kept in F32, the byte-level BPE vocabulary with
its merges, special-token ids and chat template. Weight matrices are stored in the requested
type: quantized with `gguf.quants.quantize` where it can, and for the K-quants (which gguf-py
can only dequantize) as random blocks whose f16 scales are set so that the values come out
with the spread of a trained layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig, Qwen3Config

from tests.model_helpers import save_random_checkpoint
from radixserve.models.demo import build_tokenizer

Q = GGMLQuantizationType
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Types gguf-py quantizes itself (F16 is a numpy cast).
QUANTIZABLE = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
# K-quants: byte offsets of each block's f16 scale fields (d, and dmin where the type has one).
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for an HF parameter name."""
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows -> interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def random_k_blocks(shape: tuple[int, int], qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random `qtype` blocks for a [rows, cols] matrix whose values have std 1/sqrt(cols)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)

    def set_scales(value: float) -> None:
        for offset in K_QUANT_SCALES[qtype]:
            blocks[:, :, offset:offset + 2] = np.full((rows, cols // block_size, 1), value,
                                                      dtype=np.float16).view(np.uint8)

    set_scales(1.0)  # dequantized values scale with the f16 fields: measure, then rescale
    spread = dequantize(blocks.reshape(rows, -1), qtype).std()
    set_scales(cols**-0.5 / spread)
    return blocks.reshape(rows, -1)


def stored(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """A weight matrix as GGUFWriter takes it in `qtype` (a typed array or the raw blocks)."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype in K_QUANT_SCALES:
        return random_k_blocks(values.shape, qtype, rng)
    return quantize(values, qtype)


def write_gguf(hf_dir: Path, path: Path, qtype: GGMLQuantizationType = Q.F32, *, seed: int = 0,
               extra_metadata: dict[str, int | float | str] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Write the tiny HF checkpoint in `hf_dir` as a GGUF file at `path` (weights in `qtype`),
    with `extra_metadata` (typed by value: uint32, float32 or string) and `extra_tensors`."""
    config = AutoConfig.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    weights = load_file(str(hf_dir / "model.safetensors"))
    arch = GGUF_ARCH[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(path, arch)
    writer.add_name(config.model_type)  # "mistral" tells a Mistral written as arch "llama"
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    add_tokenizer_metadata(writer, tokenizer, config)
    for key, value in (extra_metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(key, value)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)

    rng = np.random.default_rng(seed)
    for hf_name, tensor in sorted(weights.items()):
        values = tensor.float().numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            values = llama_cpp_permute(values, config.num_key_value_heads)
        if values.ndim == 2:
            data = stored(values, qtype, rng)
            raw = qtype if data.dtype == np.uint8 or qtype == Q.BF16 else None
            writer.add_tensor(gguf_name(hf_name), data, raw_dtype=raw)
        else:  # norms and biases stay F32, as llama.cpp writes them
            writer.add_tensor(gguf_name(hf_name), values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tokenizer_metadata(writer: GGUFWriter, tokenizer, config) -> None:
    """The byte-level BPE tokenizer as llama.cpp stores a "gpt2" vocabulary."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])  # 3: control
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def write_custom_checkpoint(directory: Path, config_class: type[PretrainedConfig], seed: int = 0,
                            **shape: int) -> Path:
    """A tiny random checkpoint of `config_class` with the tiny tokenizer; `shape` overrides
    the sizes (hidden 64, 2 layers, 4 query / 2 KV heads)."""
    tokenizer = build_tokenizer(320, max_length=512)
    sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512) | shape
    config = config_class(vocab_size=len(tokenizer), rms_norm_eps=1e-6, tie_word_embeddings=True, **sizes)
    return save_random_checkpoint(config, tokenizer, directory, seed)


def write_wide_llama(directory: Path) -> Path:
    """A tiny Llama whose matrices have 256-multiple rows (what the K-quant blocks need)."""
    return write_custom_checkpoint(directory, LlamaConfig, hidden_size=256, intermediate_size=512)


def write_qwen3_head128(directory: Path) -> Path:
    """A tiny Qwen3 with head_dim 128: transformers' GGUF reader ignores `attention.key_length`
    and takes Qwen3Config's default head_dim (128), so only this head size reads right there."""
    return write_custom_checkpoint(directory, Qwen3Config, head_dim=128)


def transformers_gguf(path: Path) -> torch.nn.Module:
    """transformers' own reading of the GGUF file (float32, eager attention, no EOS stop)."""
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    return model.eval()
