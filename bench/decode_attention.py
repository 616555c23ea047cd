"""Decode attention on the CPU: the compiled paged kernel against the gather + SDPA path.

Both run `TorchBackend.forward` (one layer) on the same batch of decodes over the same
shuffled pages, side by side and interleaved; the script prints the median ms per layer of
each and their ratio, and checks that the two outputs agree.

    PYTHONPATH=. python bench/decode_attention.py [--threads 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from radixserve.attention import AttentionMetadata, TorchBackend
from radixserve.native import paged_attention

# (sequences, keys each): the bench Llama's decodes at concurrency 8, a wider batch, and
# 256 x 2k, where the gather path copies the whole batch's K/V per layer.
CASES = [(8, 600), (64, 128), (32, 2048), (256, 2048)]


def time_case(num_seqs: int, num_keys: int, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
              page_size: int, repeats: int) -> dict[str, float]:
    """Median ms per layer of both paths on one random decode batch."""
    generator = torch.Generator().manual_seed(num_seqs * 100_003 + num_keys)
    pages_each = -(-num_keys // page_size)
    num_pages = num_seqs * pages_each
    order = torch.randperm(num_pages, generator=generator).view(num_seqs, pages_each).tolist()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator)
    v_cache = torch.randn(shape, generator=generator)
    q = torch.randn(num_seqs, num_qo_heads, head_dim, generator=generator)
    meta = AttentionMetadata.build(order, [num_keys] * num_seqs, [1] * num_seqs, page_size, "cpu")
    backends = {"kernel": TorchBackend(use_kernel=True), "gather": TorchBackend(use_kernel=False)}
    outputs = {}
    for name, backend in backends.items():
        backend.plan(meta, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     dtype=torch.float32)
        outputs[name] = backend.forward(q, k_cache, v_cache, sm_scale=head_dim**-0.5)  # warm-up
    torch.testing.assert_close(outputs["kernel"], outputs["gather"], atol=1e-5, rtol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(repeats):
        for name, backend in backends.items():
            start = time.perf_counter()
            backend.forward(q, k_cache, v_cache, sm_scale=head_dim**-0.5)
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per path and case")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if paged_attention.library() is None:
        raise SystemExit(f"the CPU kernel is unavailable: {paged_attention.unavailable_reason()}")
    print(f"8 query heads, 4 KV heads, head_dim 64 (the bench Llama), page size {args.page_size}, "
          f"{args.threads} thread(s), medians of {args.repeats}")
    print("| sequences x keys | gather + SDPA (ms/layer) | kernel (ms/layer) | speed-up |")
    print("|---|---|---|---|")
    for num_seqs, num_keys in CASES:
        medians = time_case(num_seqs, num_keys, num_qo_heads=8, num_kv_heads=4, head_dim=64,
                            page_size=args.page_size, repeats=args.repeats)
        print(f"| {num_seqs} x {num_keys} | {medians['gather']:.2f} | {medians['kernel']:.2f} | "
              f"{medians['gather'] / medians['kernel']:.2f}x |")


if __name__ == "__main__":
    main()
