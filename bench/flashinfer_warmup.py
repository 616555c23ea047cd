"""Build FlashInfer's just-in-time kernels for the GPU checks, all variants at once.

FlashInfer compiles each kernel variant (dtype, head size, sliding window or not, prefill or
decode) the first time a wrapper is planned with it, one after the other as the tests reach
them: about a minute of nvcc each, most of it on one core. This plans every variant that
`bench/gpu_check.sh` uses through radixserve's own backend, one process per variant, so the
builds share the machine's cores and land in FlashInfer's cache before the tests start (the
same calls as the tests, so the same modules: nothing is built twice).

    python bench/flashinfer_warmup.py            # all variants in parallel processes
    python bench/flashinfer_warmup.py --one 3    # variant 3 only (what each process runs)
    python bench/flashinfer_warmup.py --without-gpu  # the modules alone, on a machine with nvcc
                                                     # and no GPU (bench/gpu_bundle.sh --kernels)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Variant:
    """One planned layout: each distinct (dtype, head_dim, windowed, kind) is one module."""

    dtype: torch.dtype
    head_dim: int
    num_qo_heads: int
    num_kv_heads: int
    decode: bool
    window: int | None


# tests/test_flashinfer.py: head_dim 128, 2 KV heads, groups 4 (CUDA-core decode) and 8
# (tensor-core decode, which runs the FA2 prefill module), float16 and bfloat16, windows in
# bfloat16; the demo model (head_dim 64, 4 query / 2 KV heads), plain and windowed, in bfloat16.
VARIANTS = [
    Variant(dtype, 128, 8, 2, decode, None)
    for dtype in (torch.float16, torch.bfloat16) for decode in (False, True)
] + [
    Variant(torch.bfloat16, 128, 8, 2, decode, 24) for decode in (False, True)
] + [
    Variant(torch.bfloat16, 64, 4, 2, decode, window) for window in (None, 8) for decode in (False, True)
]


def plan_and_run(variant: Variant) -> None:
    """Plan and run one small batch of `variant` (builds its module on first use)."""
    from radixserve.attention import AttentionMetadata
    from radixserve.attention.flashinfer_backend import FlashInferBackend

    page_size = 16
    kv_lens, new = [40, 70], [1, 1] if variant.decode else [40, 30]
    tables = [[0, 1, 2], [3, 4, 5, 6, 7]]
    meta = AttentionMetadata.build(tables, kv_lens, new, page_size, "cuda")
    backend = FlashInferBackend("cuda")
    cache = torch.zeros(8, page_size, variant.num_kv_heads, variant.head_dim, dtype=variant.dtype, device="cuda")
    q = torch.zeros(sum(new), variant.num_qo_heads, variant.head_dim, dtype=variant.dtype, device="cuda")
    # A windowed variant plans its window alone: planning the full layer too would wait on the
    # file lock of the plain variant's build, which runs in another process.
    windows = (variant.window,)
    backend.plan(meta, num_qo_heads=variant.num_qo_heads, num_kv_heads=variant.num_kv_heads,
                 head_dim=variant.head_dim, dtype=variant.dtype, windows=windows)
    for window in windows:
        backend.forward(q, cache, cache, sm_scale=variant.head_dim ** -0.5, window=window)
    torch.cuda.synchronize()


def build_without_gpu() -> None:
    """Build every variant's module with no GPU (FLASHINFER_CUDA_ARCH_LIST names the target):
    the same module names and sources as the wrappers' plans (prefill on FA2; decode's
    tensor-core path runs the same prefill module), in one ninja run."""
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit.attention import modules

    specs = {}
    for v in VARIANTS:
        windowed = v.window is not None
        if v.decode:
            spec = modules.gen_batch_decode_module(v.dtype, v.dtype, v.dtype, torch.int32, v.head_dim, v.head_dim,
                                                   0, windowed, False)
        else:
            spec = modules.gen_batch_prefill_module("fa2", v.dtype, v.dtype, v.dtype, torch.int32, v.head_dim,
                                                    v.head_dim, 0, windowed, False, False)
        specs[spec.name] = spec
    start = time.monotonic()
    build_jit_specs(list(specs.values()))
    print(f"built {len(specs)} modules in {time.monotonic() - start:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", type=int, help="build variant N only")
    parser.add_argument("--without-gpu", action="store_true",
                        help="only build the modules, here (bench/gpu_bundle.sh --kernels)")
    # 10 builds x 2 nvcc processes: the 16 cores of the lent GPU machine busy, and at a few GB
    # an nvcc of FlashInfer's templates, well inside its 128 GB.
    parser.add_argument("--jobs-per-build", type=int, default=2, help="nvcc processes each build runs")
    args = parser.parse_args()
    if args.without_gpu:
        build_without_gpu()
        return 0
    if args.one is not None:
        plan_and_run(VARIANTS[args.one])
        return 0
    env = dict(os.environ, MAX_JOBS=str(args.jobs_per_build))
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--one", str(i)], env=env) for i in range(len(VARIANTS))]
    failed = [i for i, proc in enumerate(procs) if proc.wait() != 0]
    print(f"built {len(VARIANTS)} variants in {time.monotonic() - start:.0f} s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
