"""The Mooncake trace loader: order, expansion to tokens, and format errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from radixserve.workloads.mooncake import expand_tokens, load_mooncake_trace


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_requests_sorted_and_shared_blocks_give_shared_tokens(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1, 9]},
    ])
    first, second = load_mooncake_trace(trace)
    assert (first.timestamp_ms, second.timestamp_ms) == (0, 5)
    a, b = expand_tokens(first), expand_tokens(second)
    assert len(a) == 600 and len(b) == 1000
    assert np.array_equal(a[:512], b[:512]) and not np.any(a[512:] == b[512:600])


def test_a_hash_count_that_does_not_fit_the_length_is_named(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "bad.jsonl", [
        {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2]}])
    with pytest.raises(ValueError, match="bad.jsonl:1: 2 hash ids for 1025 tokens, expected 3"):
        load_mooncake_trace(trace)


def test_the_shipped_trace_loads() -> None:
    requests = load_mooncake_trace(Path(__file__).parent.parent / "bench/data/mooncake_synthetic_trace.jsonl")
    assert len(requests) == 3993
