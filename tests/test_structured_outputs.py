"""Constrained decoding in the engine, on the demo model (random weights, byte-level vocabulary):
every output parses and validates, with sampling, n > 1 and either sampler; unconstrained
requests beside constrained ones are untouched; preemption mid-document changes nothing; an
output cut by max_tokens says "length"."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine import sampler as sampler_module
from radixserve.grammar import GrammarSpec
from radixserve.grammar import compiled as compiled_module
from radixserve.native import sampling as native_sampling

# Strings and arrays are bounded: a random model picks the closing quote rarely, so unbounded
# ones would run into max_tokens (which the last test covers).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer",
                                                                                     "minimum": 1000,
                                                                                     "maximum": 9999}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "score", "role", "tags", "address", "active"],
}
MATRIX = {"type": "array", "minItems": 1, "maxItems": 3,
          "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": -5, "maximum": 5}}}
PROMPTS = ["Describe a person as JSON:", "hello", "The quick brown fox", "{"]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("demo", num_pages=512, page_size=16, debug_checks=True)


def assert_valid(outputs: list[Any], schema: dict[str, Any]) -> None:
    for out in outputs:
        assert out.finish_reason == "stop", (out.finish_reason, out.text)
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("schema", [PERSON, MATRIX], ids=["person", "matrix"])
@pytest.mark.parametrize("native", [True, False], ids=["c-sampler", "torch-sampler"])
def test_every_sampled_output_validates(engine: Engine, schema: dict[str, Any], native: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if native and native_sampling.library() is None:
        pytest.skip("the C sampler is not built here")
    if not native:
        monkeypatch.setattr(sampler_module.native_sampling, "usable", lambda logits: False)
    spec = GrammarSpec.json_schema(schema, "response_format")
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t, top_p=p, top_k=k, seed=i, n=4, grammar=spec)
              for i, (t, p, k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.5, 1.0, 50), (0.0, 1.0, 0)])]
    outputs = engine.generate(PROMPTS, params)
    assert len(outputs) == 16
    assert_valid(outputs, schema)
    sampled = {o.text for o in outputs[:12]}
    assert len(sampled) > 4  # sampling still samples: the constraint did not collapse it


def test_json_object_regex_and_choice(engine: Engine) -> None:
    specs = [GrammarSpec.json_object(), GrammarSpec.regex(r"[a-c]{2}-[0-9]{1,3}", "guided_regex"),
             GrammarSpec.choice(["red", "green", "blue"], "guided_choice")]
    outs = engine.generate(["x"] * 3, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1, n=4, grammar=s)
                                       for s in specs])
    # Any object: its keys are unbounded strings, which a random model may not close in time.
    assert all(isinstance(json.loads(o.text), dict) for o in outs[:4] if o.finish_reason == "stop")
    assert all(o.finish_reason in ("stop", "length") for o in outs[:4])
    assert all(o.finish_reason == "stop" for o in outs[4:]), [(o.finish_reason, o.text) for o in outs]
    import re
    assert all(re.fullmatch(r"[a-c]{2}-[0-9]{1,3}", o.text) for o in outs[4:8])
    assert all(o.text in ("red", "green", "blue") for o in outs[8:])


def test_unconstrained_neighbours_get_the_tokens_they_get_alone(engine: Engine) -> None:
    free = [SamplingParams(max_tokens=40, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(3)]
    alone = engine.generate(PROMPTS[:3], free)
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    constrained = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, n=2, grammar=spec)
    together = engine.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[2]], [free[0], constrained, free[1], free[2]])
    assert [o.token_ids for o in together if o.request_id != together[1].request_id] == [o.token_ids for o in alone]
    assert_valid([o for o in together if o.request_id == together[1].request_id], PERSON)


def test_preempted_mid_document_resumes_identically() -> None:
    spec = GrammarSpec.json_schema(PERSON, "response_format")
    constrained = SamplingParams(max_tokens=160, temperature=1.0, seed=11, grammar=spec)
    filler = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True) for _ in range(6)]
    # Last to arrive, so first to be preempted when pages run out.
    prompts = [f"filler number {i} " * 4 for i in range(6)] + [PROMPTS[0]]
    ample = Engine("demo", num_pages=512, page_size=4, debug_checks=True).generate(prompts, filler + [constrained])
    tight = Engine("demo", num_pages=56, page_size=4, max_batch_tokens=64, debug_checks=True)
    preempted: list[bool] = []
    original = tight.scheduler.preempt_unit

    def spy(unit: list[Any]) -> None:
        preempted.extend(seq.grammar is not None and len(seq.output_ids) > 0 for seq in unit)
        original(unit)

    tight.scheduler.preempt_unit = spy  # type: ignore[method-assign]
    squeezed = tight.generate(prompts, filler + [constrained])
    assert any(preempted), "the constrained request was never preempted mid-document"
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in ample]
    assert_valid(squeezed[-1:], PERSON)


def test_an_output_cut_by_max_tokens_says_length(engine: Engine) -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"text": {"type": "string"}},
                                    "required": ["text"]}, "response_format")
    out, = engine.generate(["x"], SamplingParams(max_tokens=8, temperature=1.0, seed=0, grammar=spec))
    assert out.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_constraints_refuse_ignore_eos(engine: Engine) -> None:
    """(Beam search with a grammar is supported: tests/test_beam_grammar.py.)"""
    spec = GrammarSpec.json_object()
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.add_request("x", SamplingParams(grammar=spec, ignore_eos=True))


def test_a_request_holds_its_grammar_so_other_specs_cannot_make_the_engine_thread_compile_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Other clients' specs evict a request's from the grammar cache (here a cache of one):
    a spec the server compiled and still holds is found when the engine takes the request,
    and the request's further samples (n=2) and beams start from the grammar it holds. The
    engine thread compiles nothing (one compile took seconds of a step for everyone)."""
    monkeypatch.setattr(compiled_module, "CACHE_ENTRIES", 1)
    engine = Engine("demo", num_pages=128, page_size=4, grammar_compile_timeout_s=None, debug_checks=True)
    grammars = engine.grammars
    options = ["yes", "no", "maybe"]
    spec = GrammarSpec.choice(options, "guided_choice")
    held = grammars.compile(spec)  # as the server does, off the engine thread
    grammars.compile(GrammarSpec.choice(["other"], "guided_choice"))  # evicts it
    compiles = grammars.compiles
    ids = [engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3, grammar=spec)),
           engine.add_request([5, 6, 8], SamplingParams(max_tokens=4, beam_width=2, n=2, grammar=spec))]
    del held  # the requests hold it now
    grammars.compile(GrammarSpec.choice(["another"], "guided_choice"))  # evicts it again
    texts: dict[tuple[str, int], str] = {}
    while engine.has_work():
        for request_id, deltas in engine.step().items():
            for delta in deltas:
                texts[request_id, delta.index] = texts.get((request_id, delta.index), "") + delta.text
    assert grammars.compiles == compiles + 1  # "another" alone
    assert sorted(texts) == sorted((i, j) for i in ids for j in range(2)), texts
    assert set(texts.values()) <= set(options), texts
