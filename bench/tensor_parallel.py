"""Tensor parallelism on the CPU: control bytes per step, per-rank memory, TP=2 vs TP=1 speed.

1. Control traffic: rank 0's plan bytes per decode step (batch of `--batch` sequences) at
   2k and 32k tokens of context. Only block-table *changes* travel, so the figure must not
   grow with the context (a one-layer, 16-wide model keeps the 32k prefill short).
2. Memory per rank: parameter bytes and KV bytes per page on rank 0 at TP=2 against TP=1,
   split into sharded and replicated (norms) parts.
3. Speed: decode step time at TP=1 and TP=2 on a mid-sized random Llama (float32), medians
   of `--runs` alternating runs, with the share of rank 0's step spent in all-reduces
   (its own compute of the other ranks' imbalance included: time waiting for the peer).

    PYTHONPATH=. nice -n 10 python bench/tensor_parallel.py [--contexts 2048 32768] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from radixserve import Engine, SamplingParams
from radixserve.parallel.sharding import parameter_bytes

PAGE_SIZE = 16
CORES = os.cpu_count() or 1


def checkpoint(directory: Path, *, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
               max_positions: int) -> Path:
    """A random Llama with the demo's byte-level tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.models.demo import build_tokenizer

    tokenizer = build_tokenizer(2048, max_length=max_positions)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 2000, (batch, length), generator=generator).tolist()


def decode_plan_bytes(engine: Engine, batch: int, context: int, new_tokens: int) -> list[int]:
    """Plan bytes of every step in which all `batch` sequences decode."""
    runner = engine.runner
    sizes: list[int] = []
    plan = runner.builder.plan

    def recording(chunks):
        made = plan(chunks)
        if len(chunks) == batch and all(c.num_new == 1 for c in chunks):
            sizes.append(len(made.encode()) * 4 + 4)  # the plan and its length header
        return made

    runner.builder.plan = recording
    try:
        engine.generate(prompts(batch, context, context), SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                        ignore_eos=True))
    finally:
        runner.builder.plan = plan
    return sizes


def control_traffic(root: Path, contexts: list[int], batch: int) -> None:
    ckpt = checkpoint(root / "narrow", hidden=16, intermediate=32, layers=1, heads=2, kv_heads=2,
                      max_positions=max(contexts) + 64)
    engine = Engine(str(ckpt), page_size=PAGE_SIZE, tensor_parallel_size=2, max_batch_tokens=8192,
                    num_pages=batch * (max(contexts) // PAGE_SIZE + 8))
    try:
        print(f"control bytes per decode step, batch {batch}, page size {PAGE_SIZE} (plan + length header):")
        for context in contexts:
            sizes = decode_plan_bytes(engine, batch, context, new_tokens=2 * PAGE_SIZE)
            print(f"  context {context:>6}: median {statistics.median(sizes):.0f} B, max {max(sizes)} B "
                  f"over {len(sizes)} steps (a page id travels only when a sequence starts a page)")
    finally:
        engine.close()


def step_seconds(engine: Engine, batch: int, context: int, new_tokens: int, threads: int) -> tuple[float, float]:
    """(median decode step seconds, all-reduce seconds per step on this rank) of one run with
    `threads` torch threads in this process (rank 0; the workers keep the engine's share)."""
    torch.set_num_threads(threads)
    group = getattr(engine.runner, "group", None)
    reduced = [0.0]
    if group is not None:
        all_reduce = group.all_reduce

        def timed(tensor):
            start = time.perf_counter()
            out = all_reduce(tensor)
            reduced[0] += time.perf_counter() - start
            return out

        group.all_reduce = timed
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    seqs = prompts(batch, context, 7)
    for prompt in seqs:
        engine.add_request(prompt, params)
    while engine.has_work():  # prefill, not timed
        engine.step()
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for prompt in seqs:
        engine.add_request(prompt, params)
    engine.step()  # the cache-hit admission step
    times: list[float] = []
    reduced[0] = 0.0
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if group is not None:
        group.all_reduce = all_reduce
    return statistics.median(times), reduced[0] / max(1, len(times))


def speed_and_memory(root: Path, runs: int, batch: int) -> None:
    ckpt = checkpoint(root / "mid", hidden=1024, intermediate=2816, layers=4, heads=16, kv_heads=8,
                      max_positions=4096)
    single = Engine(str(ckpt), page_size=PAGE_SIZE, num_pages=512)
    tp = Engine(str(ckpt), page_size=PAGE_SIZE, num_pages=512, tensor_parallel_size=2)
    try:
        s_sharded, s_rep = parameter_bytes(single.loaded.model)
        t_sharded, t_rep = parameter_bytes(tp.loaded.model)
        kv1 = single.stats()["kv_bytes"] // single.pool.num_pages
        kv2 = tp.stats()["kv_bytes"] // tp.pool.num_pages
        print("memory per rank (rank 0 at TP=2 vs TP=1):")
        print(f"  sharded parameters   {t_sharded / 2**20:8.2f} MiB vs {s_sharded / 2**20:8.2f} MiB "
              f"(ratio {t_sharded / s_sharded:.4f})")
        print(f"  replicated (norms)   {t_rep / 2**10:8.2f} KiB vs {s_rep / 2**10:8.2f} KiB")
        print(f"  all parameters       ratio {(t_sharded + t_rep) / (s_sharded + s_rep):.4f}")
        print(f"  KV bytes per page    {kv2} vs {kv1} (ratio {kv2 / kv1:.4f})")
        per_rank = max(1, CORES // 2)
        cases = {f"TP=1, {per_rank} thread(s)": (single, per_rank), f"TP=1, {CORES} thread(s)": (single, CORES),
                 f"TP=2, {per_rank} thread(s) per rank": (tp, per_rank)}
        times: dict[str, list[float]] = {name: [] for name in cases}
        shares: list[float] = []
        for _ in range(runs):  # alternating, so a busy moment hurts every case
            for name, (engine, threads) in cases.items():
                seconds, reduce_s = step_seconds(engine, batch, 256, 32, threads)
                times[name].append(seconds)
                if engine is tp:
                    shares.append(reduce_s / seconds)
        torch.set_num_threads(CORES)
        print(f"decode step, batch {batch}, context 256, float32, medians of {runs} alternating runs:")
        for name, values in times.items():
            print(f"  {name:<28} {statistics.median(values) * 1e3:8.2f} ms   runs {[round(t * 1e3, 1) for t in values]}")
        print(f"  all-reduce share of rank 0's TP=2 step: {statistics.median(shares):.0%} "
              f"(runs {[f'{x:.0%}' for x in shares]}; waiting for the peer included)")
    finally:
        tp.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        control_traffic(Path(tmp), args.contexts, args.batch)
        if not args.skip_speed:
            speed_and_memory(Path(tmp), args.runs, args.batch)


if __name__ == "__main__":
    main()
