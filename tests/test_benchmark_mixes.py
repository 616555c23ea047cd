"""Held-out mixes (benchmark/mixes.py): well formed, parts kept apart, run by the matrix."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from radixserve.benchmark import families
from radixserve.benchmark.matrix import build_workload, matrix_workloads
from radixserve.benchmark.mixes import HELD_OUT, merged
from radixserve.cli import main

SCALES = (1 / 32, 1 / 16)  # token scale, count scale: small and quick


@pytest.mark.parametrize("name", sorted(HELD_OUT))
def test_a_mix_is_well_formed_and_held_out(name: str) -> None:
    mix = build_workload(name, *SCALES)
    assert name not in matrix_workloads()  # held out: runs only when named
    times = [r.arrival_time for r in mix.requests]
    assert times == sorted(times) and all(r.index == i for i, r in enumerate(mix.requests))
    for r in mix.requests:
        if r.parent is not None:  # re-indexed: a turn still extends its own parent
            parent = mix.requests[r.parent]
            assert r.parent < r.index
            history = np.concatenate([parent.prompt_ids, parent.output_ids])
            assert np.array_equal(r.prompt_ids[: len(history)], history)
    again = build_workload(name, *SCALES)
    assert [r.prompt_ids.tolist() for r in mix.requests] == [r.prompt_ids.tolist() for r in again.requests]


def test_merged_parts_keep_their_order_and_offsets() -> None:
    docs = families.zipf_docs(scale=SCALES[1], token_scale=SCALES[0], seed=11)
    chats = families.chat_crowd(scale=SCALES[1], token_scale=SCALES[0], seed=12)
    mix = merged("two", [(docs, 0.0), (chats, 10_000.0)])
    assert [r.group_id for r in mix.requests[: len(docs.requests)]] == [r.group_id for r in docs.requests]
    assert mix.requests[len(docs.requests)].arrival_time >= 10_000.0
    first_pages = {tuple(r.prompt_ids[:16]) for r in docs.requests}
    assert not first_pages & {tuple(r.prompt_ids[:16]) for r in chats.requests}  # own seeds: no shared prefix


def test_drift_draws_the_ranking_anew() -> None:
    mix = build_workload("drift", *SCALES)
    quarter = len(mix.requests) // 4
    top = [np.bincount([r.group_id for r in mix.requests[k * quarter:(k + 1) * quarter]]).argmax() for k in range(4)]
    assert len(set(top)) > 1  # the most asked document changes between phases
    documents = {r.group_id: r.prompt_ids[: r.shared_len].tolist() for r in mix.requests}
    assert all(r.prompt_ids[: r.shared_len].tolist() == documents[r.group_id] for r in mix.requests)


def test_the_matrix_runs_a_mix_when_named(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    assert main(["bench", "matrix", "--quick", "--workloads", "drift", "--replicas", "1", "--no-progress",
                 "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert {c["workload"] for c in cells} == {"drift"} and len(cells) == 4  # 2 capacities x (device, + host)
    assert main(["bench", "matrix", "--workloads", "nope", "--no-progress"]) == 2
