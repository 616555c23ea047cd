"""Beam search under a grammar: every returned beam is a complete, valid document, and the
beams and scores equal transformers' beam search with a logits processor that applies the same
grammar's mask, cold, warm and when the groups are preempted.

The reference is independent of the engine's matcher bookkeeping: for every row of every step
it makes a fresh matcher and feeds it that row's whole generated text, so no state is forked,
carried or reordered there. A beam whose tokens its grammar refuses (transformers keeps such
dead beams, at -inf, when fewer than W candidates are allowed) gets an all -inf row.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar
from transformers import LogitsProcessor, LogitsProcessorList

from radixserve import Engine, SamplingParams
from radixserve.engine import beam_driver
from radixserve.grammar import GrammarSpec
from tests.engine_util import hf_model
from tests.test_beam_search import prompt_for

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["s", "m", "l", "xl"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "size", "n"],
}
MAX_NEW = 40


class ReferenceGrammarMask(LogitsProcessor):
    """Sets the scores of tokens the grammar forbids after each row's generated tokens to -inf,
    recomputing each row's grammar state from scratch at every step."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, eos: int, prompt_len: int, vocab: int) -> None:
        self.compiled, self.eos, self.prompt_len, self.vocab = compiled, eos, prompt_len, vocab

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        bitmask = xgrammar.allocate_token_bitmask(len(input_ids), self.vocab)
        dead = []
        for row, ids in enumerate(input_ids[:, self.prompt_len:].tolist()):
            matcher = xgrammar.GrammarMatcher(self.compiled, override_stop_tokens=[self.eos])
            if all(matcher.accept_token(t) for t in ids) and not matcher.is_terminated():
                matcher.fill_next_token_bitmask(bitmask, row)
            else:
                dead.append(row)
        xgrammar.apply_token_bitmask_inplace(scores, bitmask)
        scores[dead] = float("-inf")
        return scores


def hf_constrained_beams(directory: Path, compiled: xgrammar.CompiledGrammar, prompt: list[int], width: int,
                         k: int) -> list[tuple[list[int], float]]:
    """transformers' beam search under the reference mask: the k best (tokens, score)."""
    model = hf_model(str(directory))
    eos = model.config.eos_token_id
    processor = ReferenceGrammarMask(compiled, eos, len(prompt), model.config.vocab_size)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=k, do_sample=False,
                             max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0,
                             logits_processor=LogitsProcessorList([processor]),
                             return_dict_in_generate=True, output_scores=True)
    beams = []
    for i in range(k):
        generated = int((out.beam_indices[i] >= 0).sum())
        beams.append((out.sequences[i, len(prompt):len(prompt) + generated].tolist(),
                      float(out.sequences_scores[i])))
    return beams


def constrained_params(width: int, k: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, beam_width=width, n=k,
                          grammar=GrammarSpec.json_schema(SCHEMA, "response_format"))


def assert_valid_and_equal(outs, expected: list[tuple[list[int], float]]) -> None:
    assert [o.index for o in outs] == list(range(len(expected)))
    for out, (tokens, score) in zip(outs, expected):
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.token_ids == tokens, (out.text, tokens)
        assert out.score == pytest.approx(score, abs=1e-4)


@pytest.fixture(scope="module")
def compiled(tiny_llama_dir: Path) -> xgrammar.CompiledGrammar:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64)
    return engine.grammars.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))


@pytest.mark.parametrize("width,k,page_size", [(3, 3, 4), (4, 2, 1), (2, 2, 16)])
def test_constrained_beams_are_valid_and_equal_transformers(tiny_llama_dir: Path, compiled: xgrammar.CompiledGrammar,
                                                            width: int, k: int, page_size: int) -> None:
    prompt = prompt_for(seed=width * 7 + page_size)
    expected = hf_constrained_beams(tiny_llama_dir, compiled, prompt, width, k)
    engine = Engine(model=str(tiny_llama_dir), page_size=page_size, num_pages=256, debug_checks=True)
    cold = engine.generate([prompt], constrained_params(width, k))
    assert_valid_and_equal(cold, expected)
    warm = engine.generate([prompt], constrained_params(width, k))
    assert warm[0].cached_tokens > 0
    assert_valid_and_equal(warm, expected)


def test_preempted_constrained_groups_resume_with_their_grammar_states(tiny_llama_dir: Path,
                                                                       compiled: xgrammar.CompiledGrammar) -> None:
    """Five groups of three beams in 48 pages of 4 tokens: groups are preempted mid-document
    (their beams keep their matchers) and resume to transformers' beams."""
    prompts = [prompt_for(seed, length=5 + seed) for seed in range(5)]
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=48, debug_checks=True)
    preempted_mid_document: list[bool] = []
    original = engine.scheduler.preempt_unit

    def spy(unit: list) -> None:
        preempted_mid_document.extend(s.grammar is not None and len(s.output_ids) > 0 for s in unit)
        original(unit)

    engine.scheduler.preempt_unit = spy  # type: ignore[method-assign]
    outs = engine.generate(prompts, constrained_params(3, 3))
    assert any(preempted_mid_document), "no constrained group was preempted mid-document"
    for i, prompt in enumerate(prompts):
        assert_valid_and_equal(outs[3 * i: 3 * i + 3], hf_constrained_beams(tiny_llama_dir, compiled, prompt, 3, 3))


def finish_reasons(engine: Engine, params: SamplingParams) -> set[str | None]:
    """The finish reasons a request's stream ends with (a failed request has no outputs)."""
    request_id = engine.add_request(prompt_for(1), params)
    deltas = []
    while engine.has_work():
        deltas += engine.step().get(request_id, [])
    deltas += engine.take_deltas().get(request_id, [])
    return {d.finish_reason for d in deltas if d.finish_reason is not None}


def test_a_grammar_with_fewer_outputs_than_n_fails_the_request(tiny_llama_dir: Path) -> None:
    """Two allowed documents cannot make three beams: an error, never an invalid third."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    spec = GrammarSpec.regex("a|b", "guided_regex")
    assert finish_reasons(engine, SamplingParams(max_tokens=8, beam_width=3, n=3, grammar=spec)) == {"error"}
    two = engine.generate([prompt_for(1)], SamplingParams(max_tokens=8, beam_width=3, n=2, grammar=spec))
    assert sorted(o.text for o in two) == ["a", "b"]
    assert all(o.finish_reason == "stop" for o in two)


def test_a_refused_beam_token_fails_the_step(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard that stops a beam from advancing past a token its grammar refuses."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, debug_checks=True)
    monkeypatch.setattr(beam_driver.BeamGroup, "deliver",
                        lambda group, seq, logits: group.logits.__setitem__(seq.seq_id, torch.log_softmax(logits, -1)))
    assert finish_reasons(engine, constrained_params(2, 2)) == {"error"}
