"""Beam search over shared pages against W separate requests: throughput and KV pages held.

For each of `--prompts` random prompts of `--prompt-len` tokens, three runs on the demo model
(random Llama, CPU unless CUDA is there), all prompts submitted at once:

- beam:      one beam search per prompt (W beams, all W returned);
- separate:  W independent sampled requests per prompt, prefix cache on (they share the
             prompt through the tree, each decodes its own pages);
- copies:    the same W requests per prompt with the prefix cache off (W full copies).

Pages held: the distinct pages that live sequences (and kept beam hypotheses) reference,
sampled after every step; the table shows the peak and the mean over the decode steps.
Throughput: generated tokens per second of wall time and of this process's CPU time (the
steadier figure on a shared machine), counting one token per running beam per step for beam
search (what the W beams computed); each run's median over `--repeats`, the runs interleaved.

    python bench/beam_search.py [--prompts 4] [--prompt-len 256] [--width 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from radixserve import Engine, SamplingParams


@dataclass
class RunResult:
    """One run: tokens generated, seconds, and the pages live sequences held."""

    name: str
    tokens: int
    seconds: float
    cpu_seconds: float  # this process's CPU time: steadier than wall time on a shared machine
    peak_pages: int
    mean_pages: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / self.cpu_seconds


def held_pages(engine: Engine) -> int:
    """Distinct pages referenced by running sequences and kept beam hypotheses."""
    pages: set[int] = set()
    for seq in engine.scheduler.running:
        pages.update(seq.block_table)
    for req in engine._requests.values():
        if req.beam is not None:
            for hyp in req.beam.hypotheses:
                pages.update(hyp.seq.block_table)
    return len(pages)


def run(engine: Engine, name: str, prompts: list[list[int]], params: list[SamplingParams]) -> RunResult:
    engine.flush_cache()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    requests = [engine._requests[i] for i in ids]
    samples: list[int] = []
    beam_tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_work():
        engine.step()
        beam_tokens += sum(len(r.beam.running) for r in requests if r.beam is not None and not r.beam.done)
        samples.append(held_pages(engine))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    sampled = sum(len(s.output_ids) for r in requests if r.beam is None for s in r.sequences)
    decode = samples[1:] or samples
    return RunResult(name, beam_tokens + sampled, seconds, cpu_seconds, max(samples), statistics.mean(decode))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 is steadiest on a shared machine)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    width, max_tokens = args.width, args.max_tokens
    beam = SamplingParams(max_tokens=max_tokens, beam_width=width, n=width, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)
               for i in range(width)]
    num_pages = 4 * width * args.prompts * (-(-(args.prompt_len + max_tokens) // args.page_size) + 1)
    engines = {cache: Engine(model="demo", page_size=args.page_size, num_pages=num_pages,
                             enable_prefix_cache=cache) for cache in (True, False)}
    plans = [
        ("beam", engines[True], prompts, [beam] * len(prompts)),
        ("separate", engines[True], [p for p in prompts for _ in range(width)], sampled * len(prompts)),
        ("copies", engines[False], [p for p in prompts for _ in range(width)], sampled * len(prompts)),
    ]
    results: dict[str, list[RunResult]] = {name: [] for name, *_ in plans}
    for name, engine, plan_prompts, plan_params in plans:  # warm-up (first-call costs), discarded
        run(engine, name, plan_prompts[:1], plan_params[:1])
    for _ in range(args.repeats):  # interleaved, so a busy spell hurts every run alike
        for name, engine, plan_prompts, plan_params in plans:
            results[name].append(run(engine, name, plan_prompts, plan_params))

    print(f"{args.prompts} prompts x {args.prompt_len} tokens, W = {width}, {max_tokens} new tokens, "
          f"pages of {args.page_size}; median of {args.repeats}")
    print("| run | tokens/s | tokens/CPU-s | peak pages held | mean pages held (decode) |")
    print("|---|---|---|---|---|")
    summary = {}
    for name, runs in results.items():
        tps = statistics.median(r.tokens_per_s for r in runs)
        cpu_tps = statistics.median(r.tokens_per_cpu_s for r in runs)
        peak, mean = runs[0].peak_pages, runs[0].mean_pages  # deterministic: the same every run
        summary[name] = dict(tokens_per_s=tps, tokens_per_cpu_s=cpu_tps, peak_pages=peak, mean_pages=mean,
                             runs=[asdict(r) for r in runs])
        print(f"| {name} | {tps:.0f} | {cpu_tps:.0f} | {peak} | {mean:.1f} |")
    copies = summary["copies"]
    print(f"beam search holds {summary['beam']['peak_pages'] / copies['peak_pages']:.2f}x the peak pages "
          f"of W copies, {summary['beam']['peak_pages'] / summary['separate']['peak_pages']:.2f}x those "
          "of W separate requests sharing the cached prompt")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=summary), f, indent=2)


if __name__ == "__main__":
    main()
