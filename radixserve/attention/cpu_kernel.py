"""The CPU paged-attention kernel (`paged_attention.c`): compiled at first use, called via ctypes.

Torch has no paged attention for the CPU, so the torch backend would otherwise gather every
key and value a query sees into a dense copy before SDPA. This kernel reads them in place
from the pages. It is built once per machine with the C compiler (`$CC`, else `cc`) into
`$RADIXSERVE_KERNEL_DIR` (default `~/.cache/radixserve/kernels`), under a name that hashes
the source, the flags and the CPU, so a changed source or another CPU builds afresh. With no
compiler, or with `RADIXSERVE_CPU_KERNEL=0`, `load()` returns None and the torch backend
gathers as before; `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
DISABLE_ENV = "RADIXSERVE_CPU_KERNEL"  # "0" turns the kernel off
DIR_ENV = "RADIXSERVE_KERNEL_DIR"
# Tried in order: the first set that compiles is used (OpenMP and -march=native are optional).
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)
_C_INT64_P = ctypes.POINTER(ctypes.c_int64)

_unavailable: list[str] = []


def kernel_dir() -> Path:
    """Where built kernels are kept."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _build(compiler: str) -> Path | None:
    """Compile the kernel (or find it already built) and return the shared object's path."""
    source = SOURCE.read_bytes()
    for flags in FLAG_SETS:
        key = hashlib.sha256(source + repr((compiler, flags, _cpu_signature())).encode()).hexdigest()[:16]
        target = kernel_dir() / f"paged_attention-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: processes building at once never load a
        # half-written file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [compiler, *flags, "-shared", "-fPIC", "-o", partial, str(SOURCE), "-lm"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as error:
            result = None
            logger.debug("building the CPU attention kernel failed: %s", error)
        if result is not None and result.returncode == 0:
            os.replace(partial, target)
            return target
        os.unlink(partial)
        if result is not None:
            logger.debug("%s failed: %s", " ".join(command), result.stderr.strip())
    return None


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel's library, built if needed; None when it cannot be (see module docstring)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        _unavailable.append(f"{DISABLE_ENV}=0")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _unavailable.append("no C compiler (cc, gcc or $CC) on this machine")
        return None
    try:
        path = _build(compiler)
        library = ctypes.CDLL(str(path)) if path is not None else None
    except OSError as error:
        _unavailable.append(f"loading the kernel failed: {error}")
        return None
    if library is None:
        _unavailable.append(f"{compiler} could not compile {SOURCE.name}")
        logger.warning("CPU attention kernel unavailable (%s); gathering K/V instead", _unavailable[-1])
        return None
    function = library.radixserve_paged_attention
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q, k, v, kv_indices
        _C_INT64_P, _C_INT64_P, _C_INT64_P, _C_INT64_P,  # rows, page_start, lo, hi
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # rows, Hq, Hkv, D, S
        ctypes.c_float, ctypes.c_int64,  # scale, max_keys
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # out, scratch, threads
    ]
    return library


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None when the kernel is loaded."""
    load()
    return _unavailable[0] if _unavailable else None


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """Whether the kernel can run attention for these tensors (CPU, float32, contiguous)."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == torch.float32
            and k_cache.is_contiguous() and load() is not None)


class KernelRows:
    """The query rows one call attends, with each row's pages and key range (host arrays).

    Row i is row `rows[i]` of q; its sequence's pages start at `kv_indices[page_start[i]]`
    and it sees keys lo[i] .. hi[i] - 1, counted from the first listed page.
    """

    def __init__(self, rows: Tensor, page_start: Tensor, lo: Tensor, hi: Tensor) -> None:
        self.rows, self.page_start, self.lo, self.hi = (
            t.to(torch.int64).contiguous() for t in (rows, page_start, lo, hi))
        self.max_keys = int((self.hi - self.lo).max()) if len(self.rows) else 0

    def __len__(self) -> int:
        return len(self.rows)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indices: Tensor,
                    rows: KernelRows, out: Tensor, *, scale: float, scratch: Tensor) -> None:
    """Writes attention for `rows` of q ([T, Hq, D]) into the same rows of out, reading K/V
    from the caches ([P, S, Hkv, D]). `scratch` holds at least
    `scratch_elements(rows, Hq, D)` floats. Callers check `supports` first."""
    library = load()
    assert library is not None and q.is_contiguous() and out.is_contiguous()
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    threads = torch.get_num_threads()
    status = library.radixserve_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_indices.data_ptr(),
        *(ctypes.cast(t.data_ptr(), _C_INT64_P) for t in (rows.rows, rows.page_start, rows.lo, rows.hi)),
        len(rows), q.shape[1], num_kv_heads, head_dim, page_size, scale, rows.max_keys,
        out.data_ptr(), scratch.data_ptr(), threads,
    )
    if status != 0:
        raise ValueError(f"{q.shape[1]} query heads cannot share {num_kv_heads} KV heads")


def scratch_elements(rows: KernelRows, num_qo_heads: int, head_dim: int) -> int:
    """Floats of scratch a call over `rows` needs."""
    return torch.get_num_threads() * num_qo_heads * (max(rows.max_keys, 1) + head_dim)
