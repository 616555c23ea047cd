"""Broken and hostile GGUF files are refused at once, in one ValueError naming the file and what
is wrong, before anything is allocated; out-of-memory while loading is a one-line refusal too.

The files are variants of one tiny valid GGUF (a 2-layer Llama, a few hundred KiB) written by
`variant`, which copies its metadata and tensors with some keys or tensors changed: every load
here takes milliseconds, since each file is refused before the weights are read.
"""

from __future__ import annotations

import contextlib
import io
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter
from tests.gguf_helpers import write_gguf

from radixserve.models import load_model

V = GGUFValueType
DROP = None  # a metadata or tensor override that removes the key or tensor


@pytest.fixture(scope="module")
def base_gguf(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The valid tiny Llama GGUF (F32) the hostile variants are made from."""
    return write_gguf(tiny_checkpoints["llama"], tmp_path_factory.mktemp("hostile") / "base.gguf")


def variant(base: Path, path: Path, metadata: dict[str, tuple[GGUFValueType, Any] | None] | None = None,
            tensors: dict[str, np.ndarray | None] | None = None) -> Path:
    """A copy of the F32 GGUF `base` at `path`, with `metadata` keys set to (type, value) or
    dropped (None) and `tensors` replaced or dropped (None); other keys keep their types."""
    metadata, tensors = metadata or {}, tensors or {}
    reader = GGUFReader(base)
    writer = GGUFWriter(path, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in metadata:
            continue
        sub_type = field.types[-1] if field.types[0] == V.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type)
    for key, typed in metadata.items():
        if typed is not None:
            vtype, value = typed
            sub_type = GGUFValueType.get_type(value[0]) if vtype == V.ARRAY else None
            writer.add_key_value(key, value, vtype, sub_type)
    for tensor in reader.tensors:
        if tensor.name not in tensors:
            writer.add_tensor(tensor.name, np.array(tensor.data))
    for name, values in tensors.items():
        if values is not None:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def refused(path: Path, match: str) -> ValueError:
    """The ValueError loading `path` raises; it begins with the path and matches `match`."""
    with pytest.raises(ValueError, match=match) as caught:
        load_model(str(path), device="cpu")
    assert str(caught.value).startswith(f"{path}: "), caught.value
    assert "\n" not in str(caught.value)
    return caught.value


def test_an_array_longer_than_the_file_is_refused_not_read_forever(tmp_path: Path) -> None:
    """56 bytes: one uint8 array whose length field says 2**40 over 3 bytes of data. gguf's reader
    read past the end as empty slices without advancing: a hang with growing memory. Run in a
    thread, so a regression fails this test instead of hanging the suite."""
    path = tmp_path / "huge_array.gguf"
    key = b"x.arr"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", V.ARRAY, V.UINT8, 2**40) + b"\1\2\3")
    assert path.stat().st_size == 56
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            load_model(str(path), device="cpu")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread to check
            outcome.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the loader is still reading a 56-byte file after 60 s"
    assert isinstance(outcome[0], ValueError), outcome
    assert "not a readable GGUF file" in str(outcome[0]) and "runs past the end of the file" in str(outcome[0])


ARCH = "llama"
BROKEN_METADATA: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # MEDIUM-2: missing keys and wrong types were int(None) TypeErrors, KeyErrors, ZeroDivisionErrors
    ("missing block_count", {f"{ARCH}.block_count": DROP}, {}, rf"GGUF metadata {ARCH}\.block_count is missing"),
    ("missing embedding_length", {f"{ARCH}.embedding_length": DROP}, {},
     rf"{ARCH}\.embedding_length is missing"),
    ("missing context_length", {f"{ARCH}.context_length": DROP}, {}, rf"{ARCH}\.context_length is missing"),
    ("block_count a string", {f"{ARCH}.block_count": (V.STRING, "2")}, {},
     rf"{ARCH}\.block_count must be an integer, not '2'"),
    ("head_count 0", {f"{ARCH}.attention.head_count": (V.UINT32, 0)}, {},
     rf"{ARCH}\.attention\.head_count must be >= 1, got 0"),
    ("head_count_kv 0", {f"{ARCH}.attention.head_count_kv": (V.UINT32, 0)}, {},
     rf"{ARCH}\.attention\.head_count_kv must be >= 1, got 0"),
    ("head_count_kv differing per layer", {f"{ARCH}.attention.head_count_kv": (V.ARRAY, [2, 1])}, {},
     r"head_count_kv differs per layer \(\[2, 1\]\)"),
    ("no vocab_size, no embedding", {f"{ARCH}.vocab_size": DROP}, {"token_embd.weight": DROP},
     r"neither llama\.vocab_size nor a 2-D token_embd\.weight"),
    ("linear rope scaling without factor", {f"{ARCH}.rope.scaling.type": (V.STRING, "linear")}, {},
     rf"{ARCH}\.rope\.scaling\.factor is missing"),
    ("odd head size", {f"{ARCH}.rope.dimension_count": (V.UINT32, 15)}, {}, r"head size 15 is not a positive even"),
    ("eos id a string", {"tokenizer.ggml.eos_token_id": (V.STRING, "abc")}, {},
     r"tokenizer\.ggml\.eos_token_id must be an integer"),
    ("eos id outside the vocabulary", {"tokenizer.ggml.eos_token_id": (V.UINT32, 99999)}, {},
     r"eos_token_id 99999 is outside the vocabulary of 320 tokens"),
    ("chat template an integer", {"tokenizer.chat_template": (V.UINT32, 5)}, {},
     r"tokenizer\.chat_template must be a string, not 5"),
    ("no tokens", {"tokenizer.ggml.tokens": DROP}, {}, r"cannot build the tokenizer .*KeyError: 'tokens'"),
    # LOW-10: a template that cannot compile failed every chat request with a 400 blaming the messages
    ("chat template syntax error", {"tokenizer.chat_template": (V.STRING, "{% if %}{% endif %}")}, {},
     r"tokenizer\.chat_template does not compile: Expected an expression.* \(template line 1\)"),
    # MEDIUM-5: out-of-range values loaded, then every request failed
    ("context_length 0", {f"{ARCH}.context_length": (V.UINT32, 0)}, {}, rf"{ARCH}\.context_length must be >= 1"),
    ("heads not a multiple of kv heads", {f"{ARCH}.attention.head_count_kv": (V.UINT32, 3)}, {},
     r"head_count 4 is not a multiple of llama\.attention\.head_count_kv 3"),
    ("rope base NaN", {f"{ARCH}.rope.freq_base": (V.FLOAT32, float("nan"))}, {},
     r"rope\.freq_base must be a finite number > 0, got nan"),
    ("rope base 0", {f"{ARCH}.rope.freq_base": (V.FLOAT32, 0.0)}, {}, r"rope\.freq_base must be a finite number > 0"),
    ("linear factor below 1", {f"{ARCH}.rope.scaling.type": (V.STRING, "linear"),
                               f"{ARCH}.rope.scaling.factor": (V.FLOAT32, 0.5)}, {},
     r"rope\.scaling\.factor must be a finite number >= 1, got 0\.5"),
    ("negative norm epsilon", {f"{ARCH}.attention.layer_norm_rms_epsilon": (V.FLOAT32, -1.0)}, {},
     r"layer_norm_rms_epsilon must be a finite number > 0"),
    ("rope_freqs of zeros", {}, {"rope_freqs.weight": np.zeros(8, dtype=np.float32)},
     r"'rope_freqs\.weight' holds values that are not finite and > 0"),
    ("rope_freqs of the wrong length", {}, {"rope_freqs.weight": np.ones(3, dtype=np.float32)},
     r"'rope_freqs\.weight' has 3 values, not one per rotated pair \(8\)"),
    ("negative temperature default", {"general.sampling.temp": (V.FLOAT32, -1.0)}, {},
     r"general\.sampling\.temp must be in \[0, 2\], got -1\.0"),
    ("top_p default 2", {"general.sampling.top_p": (V.FLOAT32, 2.0)}, {}, r"general\.sampling\.top_p must be in \(0, 1\]"),
    # LOW-7: the message names the key and the file
    ("invalid UTF-8 in a value", {"general.name": (V.STRING, b"\xff\xfe")}, {},
     r"GGUF metadata general\.name is not valid UTF-8"),
]


@pytest.mark.parametrize(("metadata", "tensors", "match"), [case[1:] for case in BROKEN_METADATA],
                         ids=[case[0] for case in BROKEN_METADATA])
def test_broken_metadata_is_one_value_error_naming_file_and_key(
    base_gguf: Path, tmp_path: Path, metadata: dict[str, Any], tensors: dict[str, Any], match: str
) -> None:
    """`serve` reports ValueErrors as "cannot load 'X': ...", exit 2; TypeErrors, KeyErrors,
    IndexErrors and transformers' validation errors were tracebacks, exit 1."""
    refused(variant(base_gguf, tmp_path / "broken.gguf", metadata, tensors), match)


def test_a_per_layer_array_of_equal_values_loads(base_gguf: Path, tmp_path: Path) -> None:
    """llama.cpp allows per-layer head counts; equal ones are the plain value (was int(list))."""
    path = variant(base_gguf, tmp_path / "per_layer.gguf", {f"{ARCH}.attention.head_count_kv": (V.ARRAY, [2, 2])})
    assert load_model(str(path), device="cpu").config.num_key_value_heads == 2


@pytest.mark.parametrize(("key", "vtype", "value", "match"), [
    ("block_count", V.UINT32, 5000, r"block_count is 5000 \(blocks 0 to 4999\), but the file has tensors for 2 "
                                    r"blocks: 0, 1"),
    ("embedding_length", V.UINT32, 2**30, r"\.weight: checkpoint shape \(\d+, \d+\) != model shape \(\d+, "
                                          r"1073741824\)"),
    ("feed_forward_length", V.UINT64, 2**40, r"mlp\.\w+_proj\.weight: checkpoint shape"),
    ("vocab_size", V.UINT64, 2**40, r"(embed_tokens|lm_head)\.weight: checkpoint shape \(320, 64\) != model "
                                    r"shape \(1099511627776, 64\)"),
], ids=["5000 blocks", "2**30 wide", "2**40 FFN", "2**40 vocabulary"])
def test_metadata_is_checked_against_the_tensors_before_allocating(
    base_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, vtype: GGUFValueType, value: int,
    match: str,
) -> None:
    """A 376 KiB file claiming 5000 layers built them all (18 s) before its missing tensors were
    noticed; a claimed 2**40-row vocabulary asked the allocator for 256 TiB (a traceback, or
    whatever of it fit, allocated)."""
    import radixserve.models.loader as loader

    def no_allocation(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("parameters were allocated before the tensor table was checked")

    monkeypatch.setattr(loader, "materialize", no_allocation)
    refused(variant(base_gguf, tmp_path / "claims.gguf", {f"{ARCH}.{key}": (vtype, value)}), match)


def test_a_tensor_parallel_start_checks_the_file_before_any_rank_allocates(base_gguf: Path, tmp_path: Path) -> None:
    """Rank 0 checks the split before any worker starts: a GGUF file there is checked whole, as
    one process checks it (each rank built 5,000 layers, or asked for 256 TiB, before)."""
    from radixserve.parallel.loading import check_split

    check_split(str(base_gguf), 2)  # the valid file splits over 2 ranks
    for key, vtype, value, match in [("block_count", V.UINT32, 5000, r"block_count is 5000"),
                                     ("vocab_size", V.UINT64, 2**40, r"shape \(1099511627776, 64\)")]:
        path = variant(base_gguf, tmp_path / f"{key}.gguf", {f"{ARCH}.{key}": (vtype, value)})
        with pytest.raises(ValueError, match=match):
            check_split(str(path), 2)


def test_big_endian_files_are_refused_by_name(tmp_path: Path) -> None:
    """gguf.quants dequantizes as little-endian: the weights were garbage, and the load then
    failed on a misleading "GGUF v50331648" from the tokenizer."""
    path = tmp_path / "big.gguf"
    writer = GGUFWriter(path, ARCH, endianess=GGUFEndian.BIG)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(path, "big-endian GGUF files are not supported")


def test_a_file_that_is_not_gguf_is_named_as_such(tmp_path: Path) -> None:
    """An existing file with another magic was "model not found ... is no checkpoint directory"."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUX" + bytes(60))
    refused(path, r"not a GGUF file \(it starts with b'GGUX', not b'GGUF'\)")


def test_out_of_memory_while_allocating_is_a_memory_error(
    base_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.OutOfMemoryError (a RuntimeError) from `to_empty` on a GPU too small for the model."""

    def out_of_memory(self: torch.nn.Module, *, device: Any, recurse: bool = True) -> torch.nn.Module:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.nn.Module, "to_empty", out_of_memory)
    with pytest.raises(MemoryError, match=r"out of memory: 0\.0 GiB of torch\.float32 parameters do not fit on "
                                          r"cpu: CUDA out of memory"):
        load_model(str(base_gguf), device="cpu")


def test_serve_reports_out_of_memory_while_loading_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An OutOfMemoryError anywhere in the engine's construction (the KV pool, a warm-up) is
    "cannot load", exit 2, not a traceback and exit 1."""
    import radixserve

    def out_of_memory(**options: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore detail")

    monkeypatch.setattr(radixserve, "Engine", out_of_memory)
    code, stderr = serve_in_process("demo")
    assert code == 2, stderr
    assert "error: cannot load 'demo': out of memory: CUDA out of memory. Tried to allocate 20.00 GiB" in stderr
    assert "Traceback" not in stderr and "more detail" not in stderr


def serve_in_process(model: str) -> tuple[int, str]:
    """(exit status, stderr) of `radixserve serve --model model` on a free port, run in this
    process (a subprocess would spend seconds importing torch); for runs refused while loading."""
    from radixserve.cli import main

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["serve", "--host", "127.0.0.1", "--port", str(port), "--model", model])
    return code, stderr.getvalue()


def test_unsupported_storage_type_is_refused_before_allocating(
    base_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The storage types are checked with the tensor table, not tensor by tensor mid-load."""
    import radixserve.models.loader as loader

    monkeypatch.setattr(loader, "materialize", lambda *args: pytest.fail("allocated before the check"))
    reader = GGUFReader(base_gguf)
    last = reader.tensors[-1]
    path = tmp_path / "int8.gguf"
    variant(base_gguf, path, tensors={last.name: np.array(last.data).astype(np.int8)})
    assert GGUFReader(path).tensors[-1].tensor_type == GGMLQuantizationType.I8
    refused(path, rf"'{last.name}' is stored as I8")


def test_serve_reports_broken_metadata_in_one_line(base_gguf: Path, tmp_path: Path) -> None:
    """The contract the loader's ValueErrors serve: `serve` says "cannot load" in one line and
    exits 2 (a missing block_count was an int(None) traceback, exit 1)."""
    path = variant(base_gguf, tmp_path / "no_blocks.gguf", {f"{ARCH}.block_count": DROP})
    code, stderr = serve_in_process(str(path))
    assert code == 2 and "Traceback" not in stderr, stderr
    assert f"error: cannot load '{path}': {path}: GGUF metadata llama.block_count is missing" in stderr, stderr


def test_overlapping_tensor_data_is_refused(base_gguf: Path, tmp_path: Path) -> None:
    """llama.cpp writes each tensor's data after the one before; tensors sharing bytes loaded as a
    silently wrong model (LOW-12). The last tensor's offset is pointed at the first's data."""
    reader = GGUFReader(base_gguf)
    first, last = min(reader.tensors, key=lambda t: t.data_offset), reader.tensors[-1]
    *leading, _ = last.field.parts  # a tensor info ends with its data offset (uint64, relative)
    at = last.field.offset + sum(part.nbytes for part in leading)
    data = bytearray(base_gguf.read_bytes())
    data[at:at + 8] = struct.pack("<Q", first.data_offset - reader.data_offset)
    path = tmp_path / "overlap.gguf"
    path.write_bytes(bytes(data))
    refused(path, r"tensors '.+' and '.+' overlap in the file")


def test_a_huge_array_outside_the_tokenizer_is_refused(base_gguf: Path, tmp_path: Path) -> None:
    """Arrays outside the tokenizer's are decoded into Python lists (a per-layer value must not
    be skipped): one of a hundred thousand values is refused, not decoded."""
    path = variant(base_gguf, tmp_path / "junk.gguf", {f"{ARCH}.junk": (V.ARRAY, list(range(100_000)))})
    refused(path, rf"GGUF metadata {ARCH}\.junk is an array of 100,000 values; at most 65,536 outside the tokenizer's")
