"""Sliding-window models: KV pages held and decode speed, next to the same weights with full
attention.

The demo model's weights (random Llama, CPU unless CUDA is there) run three ways, the same
`--prompts` random prompts of `--prompt-len` tokens each decoding `--max-tokens` tokens, all
submitted at once:

- window:  a Mistral with a window of `--window` on every layer: running sequences release the
           pages that leave it;
- mixed:   a Qwen2 with the first layer full and the rest windowed (max_window_layers=1): the
           window is applied in attention, but every page is kept;
- full:    the same weights with full attention.

Pages held: pages in use that the tree could not evict (what running sequences keep), sampled
after every step: the peak, and the mean over the second half of the steps (by then the
windowed model's sequences have left their cached prompts, whose pages they hold under the
tree lock until all of them leave the window); the per-sequence bound is
ceil(window / page_size) + 1 for the windowed model. Speed: generated tokens per second of this process's CPU time (the steadier
figure on a shared machine), each configuration's median over `--repeats`, runs interleaved.

    python bench/sliding_window.py [--window 256] [--prompts 4] [--prompt-len 128] [--max-tokens 1536]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

from radixserve import Engine, SamplingParams
from radixserve.models.demo import windowed_demo_dir


def run(directory: Path, prompts: list[list[int]], max_tokens: int, page_size: int) -> dict[str, float]:
    """One run: peak pages held by running sequences, generated tokens per CPU second."""
    total = len(prompts) * (len(prompts[0]) + max_tokens)
    engine = Engine(model=str(directory), page_size=page_size, num_pages=math.ceil(total / page_size) + 64)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    held: list[int] = []
    start = time.process_time()
    while engine.has_work():
        engine.step()
        held.append(engine.pool.num_used - engine.tree.evictable_pages)
    seconds = time.process_time() - start
    return {"peak_pages_held": max(held), "late_pages_held": statistics.mean(held[len(held) // 2:]),
            "tokens_per_cpu_s": len(prompts) * max_tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=1536)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    root = Path(tempfile.mkdtemp(prefix="radixserve-window-"))
    models = {
        "window": windowed_demo_dir(root / "window", args.window),
        "mixed": windowed_demo_dir(root / "mixed", args.window, full_layers=1),
        "full": windowed_demo_dir(root / "full", None),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, directory in models.items():
            results[name].append(run(directory, prompts, args.max_tokens, args.page_size))
    bound = math.ceil(args.window / args.page_size) + 1
    print(f"{args.prompts} sequences x ({args.prompt_len} prompt + {args.max_tokens} generated) tokens, "
          f"window {args.window}, pages of {args.page_size} (bound per windowed sequence: {bound} pages)\n")
    print("| model | peak pages held | pages held, second half | tokens / CPU s (median) |\n|---|---|---|---|")
    summary = {}
    for name, runs in results.items():
        summary[name] = {"peak_pages_held": max(r["peak_pages_held"] for r in runs),
                         "late_pages_held": max(r["late_pages_held"] for r in runs),
                         "tokens_per_cpu_s": statistics.median(r["tokens_per_cpu_s"] for r in runs)}
        print(f"| {name} | {summary[name]['peak_pages_held']} | {summary[name]['late_pages_held']:.1f} | "
              f"{summary[name]['tokens_per_cpu_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": summary,
                                         "bound_per_sequence": bound}, indent=2))


if __name__ == "__main__":
    main()
