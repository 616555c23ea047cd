"""`radixserve bench`: what the commands say about inputs they cannot measure well — requests
skipped by the simulator, flags that contradict each other, bad arguments — each a line on
stderr rather than silently wrong numbers or a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


def _trace(path: Path, lengths: list[int]) -> Path:
    """A Mooncake-style trace of requests sharing their first 512-token block."""
    rows = [{"timestamp": i, "input_length": n, "output_length": 4, "hash_ids": list(range(-(-n // 512)))}
            for i, n in enumerate(lengths)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_simulate_says_how_many_requests_were_too_long_for_the_pool(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The skipped requests were in the JSON only: their prompt tokens counted as misses in
    every hit rate, next to bounds that assume they ran, with nothing on screen."""
    trace = _trace(tmp_path / "t.jsonl", [300, 300, 2000])
    markdown = tmp_path / "t.md"
    assert main(["bench", "simulate", "--trace", str(trace), "--capacity-tokens", "1k", "--no-progress",
                 "--markdown", str(markdown)]) == 0
    captured = capsys.readouterr()
    assert "1 of 3 requests skipped (too long for the pool)" in captured.err
    assert "Note: requests too long for the pool were skipped (1 at 1k, of 3)" in captured.out
    assert "Note: requests too long" in markdown.read_text()


def test_simulate_refuses_a_capacity_every_request_is_too_long_for(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """It showed 0.0% for every policy next to a non-zero optimum, rc 0."""
    trace = _trace(tmp_path / "t.jsonl", [2000, 2000])
    out = tmp_path / "out.json"
    assert main(["bench", "simulate", "--trace", str(trace), "--capacity-tokens", "1k", "--no-progress",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: at --capacity-tokens 1k every request is too long for the pool (the longest needs 2004" in err
    assert not out.exists()
