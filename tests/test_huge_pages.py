"""Loaded weights on transparent huge pages: one advised mapping, the same values and outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.models import load_model
from radixserve.models.huge_pages import ALIGNMENT, HUGE_PAGE, OPT_OUT, huge_pages_available, move_to_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this kernel gives no transparent huge pages")


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding `address`: its fields, and "range"."""
    entry: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            if inside:
                break
            inside = start <= address < end
            entry = {"range": head}
        elif inside:
            name, _, value = line.partition(":")
            entry[name] = value.strip()
    assert inside, f"no mapping holds {address:#x}"
    return entry


@needs_thp
def test_loaded_weights_share_one_mapping_advised_for_huge_pages(tiny_checkpoints: dict[str, Path]) -> None:
    loaded = load_model(str(tiny_checkpoints["llama_tied_bias"]), device="cpu")
    params = list(loaded.model.parameters())
    ranges = {mapping_of(param.data_ptr())["range"] for param in params}
    assert len(ranges) == 1
    assert mapping_of(params[0].data_ptr())["THPeligible"] == "1"
    assert params[0].data_ptr() % HUGE_PAGE == 0
    assert all(param.data_ptr() % ALIGNMENT == 0 and param.is_contiguous() for param in params)


@needs_thp
def test_the_move_keeps_every_value(tiny_checkpoints: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    directory = str(tiny_checkpoints["llama_tied_bias"])
    moved = load_model(directory, device="cpu").model
    monkeypatch.setenv(OPT_OUT, "0")
    plain = load_model(directory, device="cpu").model
    plain_params = dict(plain.named_parameters())
    moved_range = mapping_of(next(moved.parameters()).data_ptr())["range"]
    assert all(mapping_of(p.data_ptr())["range"] != moved_range for p in plain_params.values())
    for name, param in moved.named_parameters():
        assert param.dtype == plain_params[name].dtype and torch.equal(param, plain_params[name]), name
    # a second move of the opted-out model moves nothing; allowed again, every byte, padded to ALIGNMENT
    assert move_to_huge_pages(plain) == 0
    monkeypatch.delenv(OPT_OUT)
    expected = sum(-(-p.numel() * p.element_size() // ALIGNMENT) * ALIGNMENT for p in plain.parameters())
    assert move_to_huge_pages(plain) == expected
    for name, param in plain.named_parameters():
        assert torch.equal(param, dict(moved.named_parameters())[name]), name


def test_nothing_moves_without_cpu_parameters() -> None:
    assert move_to_huge_pages(torch.nn.Module()) == 0
    meta = torch.nn.Linear(4, 4, device="meta")
    assert move_to_huge_pages(meta) == 0


@needs_thp
@pytest.mark.parametrize("form", ["directory", "gguf"])
def test_the_weights_are_written_once_into_their_place(tiny_checkpoints: dict[str, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, form: str) -> None:
    """The loaders place the parameters on huge pages before reading the weights: moving them
    after the load copied every weight a second time (SmolLM2's GGUF: 323 MiB more peak memory). Nothing is left to move, and the values are a plain load's."""
    from tests.gguf_helpers import write_gguf

    directory = tiny_checkpoints["llama_tied_bias"]
    source = str(directory if form == "directory" else write_gguf(directory, tmp_path / "tiny.gguf"))
    placed = load_model(source, device="cpu").model
    assert move_to_huge_pages(placed) == 0  # in their place already
    params = list(placed.parameters())
    assert len({mapping_of(param.data_ptr())["range"] for param in params}) == 1
    assert mapping_of(params[0].data_ptr())["THPeligible"] == "1"
    monkeypatch.setenv(OPT_OUT, "0")
    plain = dict(load_model(source, device="cpu").model.named_parameters())
    for name, param in placed.named_parameters():
        assert param.dtype == plain[name].dtype and torch.equal(param, plain[name]), name
