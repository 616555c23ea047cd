"""Small C kernels for the CPU and their Python bindings: everything that calls into C.

Torch has no paged attention and no fused sampling for the CPU; the kernels here fill those
gaps. One module per purpose:

- `build`: compiles a kernel at first use and loads it with ctypes (or says why it cannot).
- `checks`: the one checking layer. The C code trusts its inputs, so every call into C goes
  through a check here first, which raises ValueError naming what is wrong (a page index past
  the pool, an index of the wrong dtype, a short parameter array) before C runs: a bad input
  fails the one request that carries it, never the process.
- `scratch`: per-thread scratch memory, sized with the same thread count the call runs with.
- `paged_attention` (`paged_attention.c`): decode attention read in place from the pages;
  used by `radixserve.attention.torch_backend`.
- `sampling` (`sampling.c`): the fused sampler; used by `radixserve.engine.sampler`.
- `common.h`: what both C files share (vector width, thread index, e^x).
"""
