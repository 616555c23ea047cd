"""Compiling and loading the C kernels of this package, once per process.

`library(name)` builds `<name>.c` with the C compiler (`$CC`, else `cc`) into
`$RADIXSERVE_KERNEL_DIR` (default `~/.cache/radixserve/kernels`), under a name that hashes the
source and the headers beside it, the flags and the CPU, so a changed source or another CPU
builds afresh; later processes load the built file. With no compiler, or with
`RADIXSERVE_CPU_KERNEL=0`, `library` returns None and callers keep their torch path;
`unavailable_reason(name)` says why. `declared_library` adds the one function's C signature.
Nothing here calls a kernel: the bindings do, through `checks`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent
DISABLE_ENV = "RADIXSERVE_CPU_KERNEL"  # "0" turns every CPU kernel off
DIR_ENV = "RADIXSERVE_KERNEL_DIR"
# Tried in order: the first set that compiles is used (OpenMP and -march=native are optional).
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)

_unavailable: dict[str, str] = {}


def kernel_dir() -> Path:
    """Where built kernels are kept."""
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "radixserve" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return f"{platform.machine()} {line}"
    except OSError:
        pass
    return platform.machine()


def _build(source: Path, compiler: str) -> Path | None:
    """Compile `source` (or find it already built) and return the shared object's path."""
    # The headers beside the source count too, and the sources it includes (decoder.c composes
    # the other kernels): a changed common.h or linear.c must rebuild their users.
    text = source.read_bytes()
    included = sorted(set(re.findall(rb'#include "([\w.]+\.c)"', text)))
    text += b"".join((source.parent / name.decode()).read_bytes() for name in included)
    text += b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    for flags in FLAG_SETS:
        key = hashlib.sha256(text + repr((compiler, flags, _cpu_signature())).encode()).hexdigest()[:16]
        target = kernel_dir() / f"{source.stem}-{key}.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target, then rename: processes building at once never load a
        # half-written file.
        fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        command = [compiler, *flags, "-shared", "-fPIC", "-o", partial, str(source), "-lm"]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as error:
            logger.debug("%s failed: %s", " ".join(command), error)
            result = None
        if result is not None and result.returncode == 0:
            os.replace(partial, target)
            return target
        os.unlink(partial)
        if result is not None:
            logger.debug("%s failed: %s", " ".join(command), result.stderr.strip())
    return None


@functools.cache
def library(name: str) -> ctypes.CDLL | None:
    """The library built from `<name>.c` in this package; None when it cannot be built."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        _unavailable[name] = f"{DISABLE_ENV}=0"
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _unavailable[name] = "no C compiler (cc, gcc or $CC) on this machine"
        return None
    source = SOURCES / f"{name}.c"
    try:
        path = _build(source, compiler)
        if path is not None:
            return ctypes.CDLL(str(path))
        _unavailable[name] = f"{compiler} could not compile {source.name}"
    except OSError as error:
        _unavailable[name] = f"building or loading {source.name} failed: {error}"
    logger.warning("CPU kernel %s unavailable (%s); using the torch path", name, _unavailable[name])
    return None


def declared_library(name: str, function: str, restype: type, argtypes: list[type]) -> ctypes.CDLL | None:
    """`library(name)` with `function`'s C signature declared (ctypes would otherwise guess int
    arguments and result); None when the library cannot be built."""
    loaded = library(name)
    if loaded is not None:
        declared = getattr(loaded, function)
        declared.restype = restype
        declared.argtypes = argtypes
    return loaded


def unavailable_reason(name: str) -> str | None:
    """Why `library(name)` returned None, or None when the kernel is loaded."""
    library(name)
    return _unavailable.get(name)
