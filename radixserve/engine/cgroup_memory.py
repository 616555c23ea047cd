"""How much memory this process's cgroup still lets it allocate (containers, systemd slices):
the kernel's MemAvailable counts the whole machine, so a container limited below it would
pass a size check and then be OOM-killed while filling its KV pool.

cgroup v2: `memory.max` ("max" = no limit) and `memory.current` of the process's group and of
each group above it (a parent's limit binds its children). cgroup v1: `memory.limit_in_bytes`
and `memory.usage_in_bytes` of the memory controller's group and its parents. Inactive file
pages (`inactive_file` in memory.stat) are reclaimable, so they do not count as used, as
`docker stats` computes it.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_UNLIMITED_V1 = 1 << 60  # v1 writes "no limit" as a page-rounded LONG_MAX


def cgroup_available(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Bytes the tightest limited cgroup above this process has left, or None when no limit
    applies or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    headrooms: list[int] = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            headrooms += _headrooms(root, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            headrooms += _headrooms(root / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                    "total_inactive_file")
    return min(headrooms) if headrooms else None


def _headrooms(base: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    """limit - (usage - inactive file pages) of each limited group from `path` up to `base`
    (in a namespaced container the path may not exist below the root: the root still counts)."""
    out = []
    group = base / path.strip("/")
    for directory in [group, *group.parents]:
        if not directory.is_relative_to(base):
            break
        limit = _read_int(directory / limit_file)
        if limit is None or limit >= _UNLIMITED_V1:
            continue
        usage = _read_int(directory / usage_file) or 0
        out.append(max(0, limit - max(0, usage - _inactive_file(directory / "memory.stat", inactive_key))))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _inactive_file(stat: Path, key: str) -> int:
    try:
        with stat.open() as lines:
            for line in lines:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
