"""Per-step engine overhead outside the model at 256 running sequences, without a real model.

Builds an `Engine` on a one-layer, 16-wide random Llama (so the forward pass costs next to
nothing) with attention replaced by a no-op backend (a GPU's FlashInfer plan and kernels are
not what this measures), admits 256 requests with `--context` tokens of prompt each, lets
them prefill, then times decode steps in which all 256 decode. The engine's own step-time
breakdown (`Engine.stats()["step_breakdown_s"]`) gives per step:

    schedule    the scheduler: running queue, page reservations (and admission)
    metadata    block-table mirrors, attention metadata, input tensors
    sampling    next tokens from [256, vocab] logits: half greedy, half seeded top-p
    detokenize  incremental detokenizer, stop strings (every request has two), bookkeeping
    tree        caching computed pages, releasing finished sequences

Targets (issue 13): schedule + metadata + sampling + detokenize <= 2 ms per step at
256 x 2k tokens of context and <= 5 ms at 256 x 16k. On a CPU the sampling line includes the
tensor math over the whole vocabulary (which a GPU does in microseconds), so it is shown
also with a small vocabulary.

    PYTHONPATH=. python bench/step_overhead.py [--context 2048 16384] [--vocab 32000 2048]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from radixserve import Engine, SamplingParams
from radixserve.attention.base import AttentionBackend, AttentionMetadata

SECTIONS = ("schedule", "metadata", "sampling", "detokenize")
MAX_TOKENS = 2048


class NoAttention(AttentionBackend):
    """Stands in for the attention kernel: plans nothing, returns the queries."""

    def plan(self, meta: AttentionMetadata, *, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, dtype: torch.dtype, windows: Sequence[int | None] = (None,)) -> None:
        """Nothing to plan."""

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float,
                window: int | None = None) -> Tensor:
        """The queries themselves."""
        return q


def tiny_checkpoint(directory: Path, vocab_size: int, max_positions: int) -> Path:
    """A one-layer random Llama with the demo's byte-level tokenizer (ids past the
    tokenizer's decode to nothing, as padded vocabularies do)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.models.demo import build_tokenizer

    tokenizer = build_tokenizer(2048, max_length=max_positions)
    config = LlamaConfig(vocab_size=max(vocab_size, len(tokenizer)), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # logits with a spread like a trained model's (std ~4), not flat
        model.lm_head.weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def measure(checkpoint: Path, context: int, page_size: int, steps: int, batch: int) -> dict[str, float]:
    """Mean seconds per decode step in each section, with `batch` sequences of `context`."""
    max_tokens = MAX_TOKENS  # nobody finishes during admission (one chunk a step) or timing
    num_pages = batch * (-(-(context + max_tokens) // page_size)) + 64
    engine = Engine(str(checkpoint), page_size=page_size, num_pages=num_pages, max_running=batch,
                    max_batch_tokens=65536, device="cpu", dtype="float32")
    engine.runner.backend = NoAttention()
    rng = np.random.default_rng(context)
    for i in range(batch):
        prompt = rng.integers(10, 2000, size=context).tolist()
        params = (SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=["\n\n\n", "STOP"])
                  if i % 2 else
                  SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True,
                                 stop=["\n\n\n", "STOP"]))
        engine.add_request(prompt, params)
    while len(engine.scheduler.running) < batch or any(
            s.num_computed < s.num_tokens - 1 for s in engine.scheduler.running):
        engine.step()  # prefill (the tiny model makes it quick)
        counters = engine.stats()
        if counters["requests_finished"] or counters["requests_aborted"]:
            # A step that raises ends its requests (finish_reason "error"): stop, don't spin.
            raise RuntimeError(f"{counters['requests_finished']} requests finished and "
                               f"{counters['requests_aborted']} failed before all were admitted")
    for _ in range(3):
        engine.step()  # warm up: every sequence decoding, mirrors built
    before = engine.stats()["step_breakdown_s"]
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    after = engine.stats()["step_breakdown_s"]
    assert len(engine.scheduler.running) == batch
    out = {s: (after[s] - before[s]) / steps for s in (*SECTIONS, "model", "tree")}
    out["wall"] = wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, nargs="+", default=[2048, 16384],
                        help="prompt tokens per sequence (default: 2048 16384)")
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 2048],
                        help="vocabulary sizes for the sampling cost (default: 32000 2048)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--batch", type=int, default=256, help="running sequences (default: 256)")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed (default: 20)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier figures on a shared machine; the work is host-side
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in args.vocab:
            checkpoint = tiny_checkpoint(Path(tmp) / f"v{vocab}", vocab, max(args.context) + MAX_TOKENS)
            for context in args.context:
                figures = measure(checkpoint, context, args.page_size, args.steps, args.batch)
                rows.append({"context": context, "vocab": vocab, "page_size": args.page_size, **figures})
    print(f"{args.batch} decoding sequences, page size {args.page_size}, mean ms per step over "
          f"{args.steps} steps (one CPU thread):\n")
    print("| context | vocab | " + " | ".join(SECTIONS) + " | sum | tree | model (stand-in) |")
    print("|---" * (len(SECTIONS) + 6) + "|")
    for row in rows:
        total = sum(row[s] for s in SECTIONS)
        cells = " | ".join(f"{1000 * row[s]:.2f}" for s in SECTIONS)
        print(f"| {row['context']} | {row['vocab']} | {cells} | **{1000 * total:.2f}** | "
              f"{1000 * row['tree']:.2f} | {1000 * row['model']:.2f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
