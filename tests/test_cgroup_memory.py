"""check_fits' CPU side honours cgroup limits (v2 memory.max, v1 limit_in_bytes) below
MemAvailable: a fake cgroup tree per case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.engine import engine_setup
from radixserve.engine.cgroup_memory import cgroup_available

GIB = 2**30


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_limit_minus_usage_counting_inactive_file_as_free(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/app.slice/worker\n")
    group = tmp_path / "cg" / "app.slice" / "worker"
    write(group / "memory.max", f"{4 * GIB}\n")
    write(group / "memory.current", f"{3 * GIB}\n")
    write(group / "memory.stat", f"anon 123\ninactive_file {GIB}\nactive_file 5\n")
    assert cgroup_available(tmp_path / "cg", tmp_path / "proc") == 2 * GIB


def test_v2_a_parents_tighter_limit_binds_and_max_is_no_limit(tmp_path: Path) -> None:
    write(tmp_path / "proc", "0::/app.slice/worker\n")
    write(tmp_path / "cg" / "app.slice" / "worker" / "memory.max", "max\n")
    write(tmp_path / "cg" / "app.slice" / "memory.max", f"{GIB}\n")
    write(tmp_path / "cg" / "app.slice" / "memory.current", "0\n")
    assert cgroup_available(tmp_path / "cg", tmp_path / "proc") == GIB
    write(tmp_path / "cg" / "app.slice" / "memory.max", "max\n")
    assert cgroup_available(tmp_path / "cg", tmp_path / "proc") is None


def test_v1_memory_controller_limit(tmp_path: Path) -> None:
    write(tmp_path / "proc", "5:devices:/\n4:memory:/docker/abc\n0::/\n")
    group = tmp_path / "cg" / "memory" / "docker" / "abc"
    write(group / "memory.limit_in_bytes", f"{8 * GIB}\n")
    write(group / "memory.usage_in_bytes", f"{GIB}\n")
    write(group / "memory.stat", "total_inactive_file 0\n")
    write(tmp_path / "cg" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "none"
    assert cgroup_available(tmp_path / "cg", tmp_path / "proc") == 7 * GIB


def test_no_cgroup_file_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_available(tmp_path / "cg", tmp_path / "missing") is None


def test_check_fits_refuses_a_pool_over_the_cgroup_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_setup, "_mem_available", lambda: 64 * GIB)
    monkeypatch.setattr(engine_setup, "cgroup_available", lambda: 2 * GIB)
    assert engine_setup.available_memory(torch.device("cpu")) == 2 * GIB
    with pytest.raises(ValueError, match="kv_memory_gb: .* 2.0 GiB of cpu memory available"):
        engine_setup.check_fits(3 * GIB, torch.device("cpu"), "kv_memory_gb", "3 GiB")
    engine_setup.check_fits(GIB, torch.device("cpu"), "kv_memory_gb", "1 GiB")
    monkeypatch.setattr(engine_setup, "cgroup_available", lambda: None)
    assert engine_setup.available_memory(torch.device("cpu")) == 64 * GIB
