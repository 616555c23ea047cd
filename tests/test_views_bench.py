"""bench/view_cost.py, which docs/benchmark.md tells readers to run for the cache views' cost
per step, runs (on a tiny tree): it imported `device_page_hashes`, gone from tree_copy.py, and
failed with ImportError before measuring anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "view_cost.py"


def test_view_cost_runs_and_reports_every_row() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--groups", "2", "--branches", "10", "--runs", "1",
                           "--long-prompts", "3", "--long-tokens", "300"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| view")]
    assert [row.split(" | ")[0] for row in rows] == [
        "| tree view (2000 nodes, hashes)", "| event subscribe (first reader)", "| 16 tree views, distinct max_nodes",
        "| tree view with text (3 x 300-token prompts, top_k 100)"]
