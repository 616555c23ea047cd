"""A checkpoint's generation_config.json: its stop tokens end generation, and its sampling
defaults apply where a request leaves them unset (unless generation_config="none")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest

from radixserve import Engine, SamplingParams
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.translate import chat_call

PROMPT = [5, 17, 33, 2, 9, 41]


def with_generation_config(source: Path, target: Path, **fields: object) -> Path:
    shutil.copytree(source, target)
    (target / "generation_config.json").write_text(json.dumps(fields))
    return target


def test_a_stop_token_listed_only_in_generation_config_stops(tiny_llama_dir: Path, tmp_path: Path) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    plain = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64).generate([PROMPT], greedy)[0]
    assert plain.finish_reason == "length"
    # The first token of the output that does not appear before it: generation must end there.
    stop_at = next(i for i, t in enumerate(plain.token_ids) if i > 0 and t not in plain.token_ids[:i])
    stop = plain.token_ids[stop_at]
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert stop != config.get("eos_token_id")
    checkpoint = with_generation_config(tiny_llama_dir, tmp_path / "ckpt", eos_token_id=[stop, 10**6])
    engine = Engine(model=str(checkpoint), page_size=4, num_pages=64)
    assert stop in engine.eos_token_ids
    out = engine.generate([PROMPT], greedy)[0]
    assert out.token_ids == plain.token_ids[: stop_at + 1] and out.finish_reason == "stop"


def test_sampling_defaults_apply_where_unset(tiny_llama_dir: Path, tmp_path: Path) -> None:
    checkpoint = with_generation_config(tiny_llama_dir, tmp_path / "ckpt", temperature=0.0, top_p=0.9, top_k=20,
                                        repetition_penalty=1.1)
    engine = Engine(model=str(checkpoint), page_size=4, num_pages=64)
    assert engine.sampling_defaults == {"temperature": 0.0, "top_p": 0.9, "top_k": 20}
    defaults = engine.default_sampling_params(max_tokens=8)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.0, 0.9, 20, 8)
    assert engine.default_sampling_params(temperature=0.7).temperature == 0.7
    # No params at all: the checkpoint's greedy default, so two runs agree.
    first, second = (engine.generate([PROMPT])[0].token_ids for _ in range(2))
    assert first == second == engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0))[0].token_ids
    ignoring = Engine(model=str(checkpoint), page_size=4, num_pages=64, generation_config="none")
    assert ignoring.sampling_defaults == {} and ignoring.default_sampling_params().temperature == 1.0
    with pytest.raises(ValueError, match="generation_config"):
        Engine(model=str(checkpoint), page_size=4, num_pages=64, generation_config="vllm")


def test_the_server_fills_unset_fields_from_the_defaults() -> None:
    def call(**fields: object) -> SamplingParams:
        body = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}], **fields})
        request = msgspec.json.decode(body, type=ChatCompletionRequest)
        return chat_call(request, [1, 2, 3], 0, 4096, defaults={"temperature": 0.2, "top_k": 5}).params

    unset = call()
    assert (unset.temperature, unset.top_k, unset.top_p) == (0.2, 5, 1.0)
    chosen = call(temperature=1.5, top_k=0, top_p=0.5)
    assert (chosen.temperature, chosen.top_k, chosen.top_p) == (1.5, 0, 0.5)
