"""A loaded model's CPU parameters moved into one mapping on transparent huge pages.

A decode step at a few rows streams every weight once from memory. On 4 KiB pages a
135M-parameter model in bfloat16 spans 66,000 pages, each a TLB miss and a page walk (two
nested walks in a virtual machine), and the CPU's hardware prefetchers stop at every page
boundary. Linux backs an anonymous mapping advised MADV_HUGEPAGE with 2 MiB pages where it
can, and Linux's default THP mode ("madvise") gives huge pages to nothing else. Measured on a
2-core EPYC VM: a plain bfloat16 stream ran at 41 GB/s against 36 GB/s, the batch-1 engine
step of SmolLM2-135M 0.94x in both float32 and bfloat16 (docs/benchmark.md).

The loaders place a model's parameters in the mapping before the weights are read
(`place_on_huge_pages`), so each weight is written once, where it stays; a model built another
way is moved after (`move_to_huge_pages`: each parameter copied into the mapping and pointed
at it). Either way the values, shapes, dtypes and parameter objects (so tied weights) are
unchanged. (Moving after the load copied every weight a second time: loading SmolLM2's GGUF peaked
1,036 MiB above the imports against 713 MiB now, in the same time.) Nothing happens off Linux, off the CPU,
where the kernel has THP off ("never") or where RADIXSERVE_HUGE_PAGES=0.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # bytes between tensors: a cache line, so no two tensors share one
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
OPT_OUT = "RADIXSERVE_HUGE_PAGES"


def huge_pages_available() -> bool:
    """Whether an anonymous mapping advised MADV_HUGEPAGE can get huge pages here."""
    if os.environ.get(OPT_OUT, "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of `nbytes` starting on a huge-page boundary, in an anonymous
    mapping advised MADV_HUGEPAGE (the tensor keeps the mapping alive). The mapping spans whole
    huge pages past that boundary: a partial one at the end would stay on small pages."""
    whole_pages = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, whole_pages + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def place_on_huge_pages(model: nn.Module) -> int:
    """Points every CPU parameter of `model` at its place in one huge-page mapping, zeroed, for
    the weights to be written into (a loader calls it between building the model and reading
    the weights); returns the bytes placed (0 when huge pages are unavailable or nothing is on
    the CPU, and the parameters are left as they are). A later `move_to_huge_pages` moves
    nothing."""
    return _to_huge_pages(model, copy=False)


def move_to_huge_pages(model: nn.Module) -> int:
    """Moves every CPU parameter of `model` into one huge-page mapping; returns the bytes moved
    (0 when huge pages are unavailable, nothing is on the CPU, or the parameters were placed
    there already). Call before the first step: a kernel that cached a parameter's address (the
    decoder kernel's weights) must look again."""
    return _to_huge_pages(model, copy=True)


def _to_huge_pages(model: nn.Module, *, copy: bool) -> int:
    if getattr(model, _PLACED, False):
        return 0
    params = [p for p in model.parameters() if p.device.type == "cpu" and p.numel()]
    if not params or not huge_pages_available():
        return 0
    offsets, total = [], 0
    for param in params:
        offsets.append(total)
        total += -(-param.numel() * param.element_size() // ALIGNMENT) * ALIGNMENT
    try:
        buffer = huge_page_buffer(total)
    except (OSError, ValueError) as exc:  # no address space or a kernel without the advice
        logger.info("weights stay on normal pages: %s", exc)
        return 0
    with torch.no_grad():
        for param, offset in zip(params, offsets, strict=True):
            nbytes = param.numel() * param.element_size()
            moved = buffer[offset:offset + nbytes].view(param.dtype).view(param.shape)
            if copy:
                moved.copy_(param.data)
            param.data = moved
    setattr(model, _PLACED, True)
    return total


_PLACED = "_radixserve_on_huge_pages"  # set on a module whose parameters are in the mapping
