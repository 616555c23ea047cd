"""Write a model as radixserve loads it (weights in float32) as a transformers checkpoint
directory: config.json, model.safetensors and the tokenizer files.

Used by build_llama_server.sh so that llama.cpp's own converter (convert_hf_to_gguf.py, which
reads HF checkpoints only) can make an F32 / Q8_0 GGUF of exactly the weights radixserve serves.
For `--model smollm2` those are the packaged Q4_1 GGUF dequantised to float32.

    PYTHONPATH=. python bench/export_hf_checkpoint.py --model smollm2 --out /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from radixserve.models.loader import load_model


def export(model: str, out: Path) -> None:
    """Load `model` in float32 on the CPU and save it (weights, config, tokenizer) under `out`."""
    loaded = load_model(model, dtype="float32", device="cpu")
    config = loaded.config
    config.dtype = torch.float32
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ours = loaded.model.state_dict()
    missing, unexpected = hf_model.load_state_dict(ours, strict=False)
    tied = {"lm_head.weight"} if loaded.model.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise SystemExit(f"state dicts differ: missing {missing}, unexpected {unexpected}")
    if tied:
        hf_model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    export(args.model, args.out)


if __name__ == "__main__":
    main()
