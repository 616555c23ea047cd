"""radixserve/grammar: specs are checked, compiled once, matched per sequence, and the token
mask reaches the logits exactly (the C function and the fallback kernel agree with a plain
reference)."""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio
import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.engine import sampler
from radixserve.engine.params import SamplingParams
from radixserve.grammar import GrammarError, Grammars, GrammarSpec, MaskBuffer, TokenMask
from radixserve.grammar import matcher as matcher_module
from radixserve.models.demo import demo_checkpoint_dir
from radixserve.native import sampling as native_sampling
from radixserve.server.grammar_compiles import GrammarCompiles


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(demo_checkpoint_dir()))


@pytest.fixture(scope="module")
def grammars(tokenizer: PreTrainedTokenizerBase) -> Grammars:
    return Grammars(tokenizer, 2048, [tokenizer.eos_token_id])


def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The masked logits, bit by bit in plain torch."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        for token in range(vocab):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize(("schema", "fragment"), [
    ({"type": "nonsense"}, "invalid JSON Schema"),
    ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "['properties']['a']['minimum']"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "properties.a.not"),
    ({"if": {"type": "string"}}, "at if"),
    (False, "accepts no value"),
    ([1, 2], "must be an object"),
    # re raises OverflowError (not re.error) for a count past 2**32 - 1: a 400, not a 500
    ({"type": "string", "pattern": "a{99999999999}"}, "cannot be compiled: the repetition number is too large"),
    ({"patternProperties": {"b{99999999999}": {}}}, "cannot be compiled"),
    # compile time quadratic in an object's optional properties: their squares are bounded
    ({"type": "object", "properties": {f"p{i}": {} for i in range(363)}}, "add up to 131769, at most 131072"),
    ({"properties": {f"o{j}": {"properties": {f"p{i}": {} for i in range(100)}} for j in range(14)}},
     "add up to 140196"),  # 14 objects of 100 and the outer one of 14
    # a property (or definition) named like a data keyword is still a schema to count
    ({"type": "object", "properties": {"default": {"type": "object", "properties": {
        f"p{i}": {} for i in range(400)}}}, "required": ["default"]}, "add up to 160000"),
    ({"$defs": {"enum": {"properties": {f"p{i}": {} for i in range(400)}}}, "$ref": "#/$defs/enum"}, "add up to 160000"),
    ({"properties": {"examples": {"type": "string", "pattern": "a{0,100000}"}}}, "repeat too much"),
    # what failed only the compile (xgrammar's source file in the 400) or became any value: a
    # pointer at nothing, a named anchor, an empty enum
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/X"}}}, 'at properties.a: $ref "#/$defs/X" points at nothing'),
    ({"$defs": {"A/B": {"type": "integer"}}, "$ref": "#/$defs/A~1C"}, "points at nothing"),
    ({"$defs": {"X": {"$anchor": "x", "type": "integer"}}, "$ref": "#x"}, "names an anchor"),
    ({"type": "object", "properties": {"a": {"enum": []}}}, "at properties.a: enum [] allows no value"),
    # the size is checked before the schema (the validator takes seconds over a megabyte): an
    # invalid schema too large is refused for its size
    ({"type": "nonsense", "anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}] * 2000},
     "at most 65536 characters"),
    # what the grammar engine would half honour: a combinator beside constraints (it follows the
    # combinator alone: this one became any JSON value), several allOf schemas, enum values of
    # another type than declared, constraints without a type
    ({"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"], "allOf": [{}]},
     "at the top: allOf beside properties, required, type"),
    ({"type": "object", "properties": {"a": {"type": "integer", "anyOf": [{"minimum": 1}]}}},
     "at properties.a: anyOf beside type"),
    ({"oneOf": [{"type": "string"}], "maxLength": 3}, "oneOf beside maxLength"),
    ({"allOf": [{"required": ["a"]}, {"required": ["b"]}]}, "allOf of several schemas"),
    ({"type": "integer", "enum": ["Paris", 1]}, 'the value "Paris" of enum/const is not of type "integer"'),
    ({"type": "object", "properties": {"a": {"type": "string", "const": 5}}}, "at properties.a: the value 5"),
    ({"type": "object", "properties": {"n": {"minimum": 5}}}, "at properties.n: minimum without a type"),
    ({"anyOf": [{"required": ["a"]}, {"type": "null"}]}, "at anyOf[0]: required without a type"),
    # a reference outside the schema: the engine fetches nothing and took it for any value
    ({"$ref": "https://example.com/person.json"}, 'at the top: $ref "https://example.com/person.json" points outside'),
    ({"type": "object", "properties": {"p": {"$ref": "person.json#/name"}}}, "at properties.p: $ref"),
    # kept for integers only: {"multipleOf": 0.5} gave 5.996446
    ({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.5}}},
     'at properties.price: multipleOf on type "number"'),
    ({"type": ["number", "null"], "multipleOf": 2}, 'multipleOf on type "number"'),
])
def test_bad_schemas_are_refused_naming_the_field(schema: object, fragment: str) -> None:
    with pytest.raises(GrammarError) as caught:
        GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
    assert caught.value.param == "response_format.json_schema.schema"
    assert fragment in str(caught.value)


def test_optional_properties_within_the_bound_and_required_ones_pass() -> None:
    assert GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {} for i in range(362)}}, "s")
    names = [f"p{i}" for i in range(2000)]  # required ones cost nothing of the bound
    assert GrammarSpec.json_schema({"type": "object", "properties": {n: {} for n in names}, "required": names}, "s")
    half = {"type": "object", "properties": {n: {} for n in names[:400]}, "required": names[:100]}
    assert GrammarSpec.json_schema(half, "s")  # 300 optional: 90000, within
    with pytest.raises(GrammarError, match="add up to 180000"):  # twice over
        GrammarSpec.json_schema({"allOf": [half, dict(half, title="again")]}, "s")


@pytest.mark.parametrize("schema", [
    {"allOf": [{"$ref": "#/$defs/A"}], "description": "pydantic's field", "$defs": {"A": {"type": "integer"}}},
    {"oneOf": [{"type": "string"}, {"type": "null"}], "discriminator": {"propertyName": "kind"}, "title": "t"},
    {"type": ["integer", "null"], "enum": [1, None, 2.0]},
    {"type": "array", "uniqueItems": True},  # not enforced (documented): pydantic's sets write it
    {"type": "object", "properties": {"allOf": {"type": "string"}, "uniqueItems": {"const": True}}},
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},  # an object, taken from properties
    {"items": {"type": "integer"}, "minItems": 1},  # an array, from items
    {"format": "date"},  # an annotation
    {"type": "integer", "multipleOf": 5},  # enforced for integers
])
def test_what_the_engine_honours_whole_passes(schema: object) -> None:
    assert GrammarSpec.json_schema(schema, "s").kind == "json_schema"


def test_keyword_names_as_property_names_are_not_keywords() -> None:
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {}}},
                                   "x")
    assert spec.kind == "json_schema"


def test_compiled_grammars_are_cached_by_spec(grammars: Grammars) -> None:
    first = grammars.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "x"))
    again = grammars.compile(GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "x"))
    other = grammars.compile(GrammarSpec.json_schema({"type": "object", "properties": {"b": {"type": "integer"}}}, "x"))
    assert first is again and other is not first


def test_a_grammar_that_does_not_compile_names_the_field(grammars: Grammars) -> None:
    with pytest.raises(GrammarError) as caught:
        grammars.compile(GrammarSpec.ebnf("root ::= undefined_rule", "guided_grammar"), "guided_grammar")
    assert caught.value.param == "guided_grammar"
    # the library's message without its own source place ("/project/cpp/...cc:123: ")
    assert str(caught.value) == "guided_grammar: cannot compile this ebnf: EBNF parser error at line 1, column 10: " \
                                "Rule \"undefined_rule\" is not defined"
    with pytest.raises(GrammarError):
        grammars.compile(GrammarSpec.json_schema({"$ref": "#/$defs/missing"}, "x"), "x")


def test_references_within_the_schema_are_followed() -> None:
    schema = {"$defs": {"A/B": {"type": "integer"}, "C D": {"type": "string"}, "x~y": {"type": "boolean"}},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/A~1B"}, "c": {"$ref": "#/$defs/C%20D"},
                                               "x": {"$ref": "#/$defs/x~0y"}, "b": {"$ref": "#/properties/a"},
                                               "r": {"type": "array", "items": {"$ref": "#"}},
                                               "t": {"type": "array", "prefixItems": [{"type": "null"}]},
                                               "u": {"$ref": "#/properties/t/prefixItems/0"}}}
    assert GrammarSpec.json_schema(schema, "x").kind == "json_schema"


def test_a_refused_spec_is_refused_again_from_the_cache_naming_each_callers_field(grammars: Grammars) -> None:
    """A client repeating a refused spec is answered at once (the refusal cached by the whole
    spec), each time naming its own field; another scope's same spec compiles for itself
    (a cached refusal must not tell one tenant what another sent)."""
    bad = GrammarSpec.regex("(unclosed", "guided_regex")
    with pytest.raises(GrammarError) as first:
        grammars.compile(bad, "guided_regex")
    assert str(first.value).startswith("guided_regex: cannot compile this regex: ")
    compiles, repeated = grammars.compiles, grammars.refusals_repeated
    with pytest.raises(GrammarError) as again:
        grammars.compile(bad, "response_format")
    assert again.value.param == "response_format"
    assert str(again.value) == "response_format" + str(first.value).removeprefix("guided_regex")
    assert (grammars.compiles, grammars.refusals_repeated) == (compiles, repeated + 1)
    with pytest.raises(GrammarError) as other:
        grammars.compile(dataclasses.replace(bad, scope=("another tenant", None)), "guided_regex")
    assert str(other.value) == str(first.value)
    assert (grammars.compiles, grammars.refusals_repeated) == (compiles + 1, repeated + 1)
    # Through the server's compile slots: refused again while another tenant holds every slot.
    slots = GrammarCompiles(slots=1)

    async def refused_while_every_slot_is_held() -> str:
        async with slots.slots.hold("another tenant"):
            with anyio.fail_after(30), pytest.raises(GrammarError) as caught:
                await slots.compile(grammars, bad, "guided_regex", "tenant")
        return str(caught.value)

    assert anyio.run(refused_while_every_slot_is_held) == str(first.value)


def allowed_tokens(grammars: Grammars, matcher: object) -> set[int]:
    mask = TokenMask.for_rows([(0, matcher)], grammars.vocab_size)  # type: ignore[list-item]
    logits = torch.zeros(1, grammars.vocab_size)
    mask.apply(logits)
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_matcher_follows_a_document_and_then_allows_only_the_end(tokenizer: PreTrainedTokenizerBase,
                                                                 grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"]}
    matcher = grammars.matcher(GrammarSpec.json_schema(schema, "x"))
    ids = tokenizer.encode('{"n": 7}', add_special_tokens=False)
    for token in ids:
        assert token in allowed_tokens(grammars, matcher)
        assert matcher.accept(token)
    assert allowed_tokens(grammars, matcher) == {tokenizer.eos_token_id}
    assert not matcher.accept(ids[0])  # refused, state unchanged
    assert matcher.accept(tokenizer.eos_token_id) and matcher.terminated


def accepts_whole(grammars: Grammars, tokenizer: PreTrainedTokenizerBase, spec: GrammarSpec, text: str) -> bool:
    """Whether a fresh matcher of `spec` takes `text` and may end right after it."""
    matcher = grammars.matcher(spec)
    return (all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False))
            and matcher.accept(tokenizer.eos_token_id))


@pytest.mark.parametrize(("bounds", "allowed"), [
    ({"minimum": 1.5, "maximum": 4.5}, [2, 3, 4]),
    ({"exclusiveMinimum": 1.5, "exclusiveMaximum": 4.5}, [2, 3, 4]),
    ({"minimum": -2.5, "exclusiveMaximum": 1.0}, [-2, -1, 0]),  # a whole float bound as it is
    ({"minimum": 3, "exclusiveMinimum": 1.5, "maximum": 4.9, "exclusiveMaximum": 4}, [3]),  # the tighter kept
])
def test_fractional_integer_bounds_allow_the_integers_between_them(
        grammars: Grammars, tokenizer: PreTrainedTokenizerBase, bounds: dict[str, float], allowed: list[int]) -> None:
    """xgrammar refuses an integer bound that is not whole ("must be a whole number": a 400 for a
    valid schema); the spec rounds each to the whole one allowing the same integers."""
    for schema in ({"type": "integer", **bounds}, {"type": ["integer", "null"], **bounds}):
        spec = GrammarSpec.json_schema(schema, "response_format")
        assert [n for n in range(-4, 7) if accepts_whole(grammars, tokenizer, spec, str(n))] == allowed
    assert json.loads(spec.source)["minimum"] == allowed[0]  # the schema's own object is not changed
    assert "minimum" not in bounds or bounds["minimum"] == schema["minimum"]


def test_fork_and_rollback_keep_states_apart(tokenizer: PreTrainedTokenizerBase, grammars: Grammars) -> None:
    matcher = grammars.matcher(GrammarSpec.choice(["yes", "no"], "guided_choice"))
    start = allowed_tokens(grammars, matcher)
    fork = matcher.fork()
    (first, *_) = tokenizer.encode("yes", add_special_tokens=False)
    assert fork.accept(first)
    assert allowed_tokens(grammars, matcher) == start  # the original did not move
    fork.rollback(1)
    assert allowed_tokens(grammars, fork) == start


def test_prepared_masks_equal_fresh_fills_and_go_stale_when_the_state_moves(
        tokenizer: PreTrainedTokenizerBase, grammars: Grammars) -> None:
    """A prepared mask (filled ahead, right after the accept) is the fill of the state it was
    prepared in; accept and rollback make it stale (a fresh fill is used then), and a step's
    mask of several rows built in a reused buffer equals one built afresh."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "yz"]}},
                                    "required": ["a"]}, "x")
    prepared, fresh = grammars.matcher(spec), grammars.matcher(spec)
    buffer = MaskBuffer()
    for token in tokenizer.encode('{"a": "yz"}', add_special_tokens=False):
        prepared.prepare()
        assert allowed_tokens(grammars, prepared) == allowed_tokens(grammars, fresh)
        pair = TokenMask.for_rows([(0, prepared), (1, fresh)], grammars.vocab_size, buffer)
        assert torch.equal(pair.bitmask[0], pair.bitmask[1])
        assert prepared.accept(token) and fresh.accept(token)  # not prepared again: must fill afresh
        assert allowed_tokens(grammars, prepared) == allowed_tokens(grammars, fresh)
    prepared.prepare()
    before = allowed_tokens(grammars, prepared)
    prepared.rollback(1)
    fresh.rollback(1)
    assert allowed_tokens(grammars, prepared) == allowed_tokens(grammars, fresh) != before


def test_length_bounded_strings_exclude_control_characters(tokenizer: PreTrainedTokenizerBase,
                                                           grammars: Grammars) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    matcher = grammars.matcher(GrammarSpec.json_schema(schema, "x"))
    for token in tokenizer.encode('{"s": "', add_special_tokens=False):
        assert matcher.accept(token)
    allowed = allowed_tokens(grammars, matcher)
    texts = {t: tokenizer.decode([t]) for t in allowed}
    assert not [t for t, text in texts.items() if any(ord(c) < 0x20 for c in text)]
    assert any(text == "a" for text in texts.values())


@pytest.mark.parametrize("native", [True, False], ids=["c", "torch"])
@pytest.mark.parametrize("vocab", [2048, 1000, 33])
def test_token_mask_sets_exactly_the_forbidden_logits(native: bool, vocab: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if native and native_sampling.mask_library() is None:
        pytest.skip("the C sampler is not built here")
    if not native:
        monkeypatch.setattr(matcher_module.native_sampling, "usable", lambda logits: False)
    generator = torch.Generator().manual_seed(vocab)
    rows = [5, 0, 3]
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32,
                            generator=generator)
    bitmask[0, 0] = -1  # a word with every token allowed
    bitmask[1, -1] = 0  # and one with none
    logits = torch.randn(6, vocab, generator=generator)
    expected = reference_mask(logits, bitmask, rows)
    TokenMask(bitmask, rows).apply(logits)
    assert torch.equal(logits, expected)
    assert TokenMask(bitmask, rows).select(3).rows == [0] and TokenMask(bitmask, rows).select(1) is None


def test_token_mask_arguments_are_checked_before_c() -> None:
    if native_sampling.mask_library() is None:
        pytest.skip("the C sampler is not built here")
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="masked rows"):
        native_sampling.apply_token_mask(logits, [2], torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        native_sampling.apply_token_mask(logits, [0], torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        native_sampling.apply_token_mask(logits, [0], torch.zeros(1, 2, dtype=torch.int64))


def test_choice_and_regex_specs(grammars: Grammars, tokenizer: PreTrainedTokenizerBase) -> None:
    matcher = grammars.matcher(GrammarSpec.regex("[0-9]{3}", "guided_regex"))
    for token in tokenizer.encode("123", add_special_tokens=False):
        assert matcher.accept(token)
    assert allowed_tokens(grammars, matcher) == {tokenizer.eos_token_id}
    with pytest.raises(GrammarError):
        GrammarSpec.choice([], "guided_choice")
    assert json.loads(GrammarSpec.choice(["a", "b"], "x").source) == ["a", "b"]


@pytest.mark.parametrize("option", ["🌧️ Zürich", "日本語", 'a"b\\c', "line\nbreak"])
def test_a_choice_matches_its_characters_exactly(grammars: Grammars, tokenizer: PreTrainedTokenizerBase,
                                                 option: str) -> None:
    # Characters past the BMP once reached xgrammar as JSON surrogate escapes, which it reads
    # as two lone surrogates: the option itself was refused and U+FFFD bytes allowed instead.
    matcher = grammars.matcher(GrammarSpec.choice([option, "other"], "guided_choice"))
    for token in tokenizer.encode(option, add_special_tokens=False):
        assert matcher.accept(token), (option, token)
    assert allowed_tokens(grammars, matcher) == {tokenizer.eos_token_id}


def test_the_tool_calls_grammar_constrains_only_the_calls(grammars: Grammars,
                                                            tokenizer: PreTrainedTokenizerBase) -> None:
    weather = GrammarSpec.json_schema({"type": "object", "properties": {"city": {"type": "string"}},
                                       "required": ["city"], "additionalProperties": False}, "p")

    def takes(text: str, parallel: bool = True) -> bool:
        matcher = grammars.matcher(GrammarSpec.tool_calls([("get_weather", weather), ("add", None)], parallel, "tools"))
        return all(matcher.accept(token) for token in tokenizer.encode(text, add_special_tokens=False))

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert takes("Let me look that up. " + call + " It is sunny.")
    assert takes(call + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "any": [true]}}\n</tool_call>')
    assert not takes('<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}')  # not its schema
    assert not takes('<tool_call>\n{"name": "send_email", "arguments": {}}')  # not a declared tool
    assert not takes('<tool_call>\n{"name": "get_weather", "arguments": {"city":  "Paris"}}')  # no free whitespace
    assert not takes(call + " and " + call, parallel=False)  # one call, then the end


def test_the_c_sampler_masks_rows_as_it_samples_them() -> None:
    if native_sampling.library() is None:
        pytest.skip("the C sampler is not built here")
    generator = torch.Generator().manual_seed(5)
    vocab, rows = 1000, [3, 0]
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(4, vocab, generator=generator) * 3
    premasked = reference_mask(logits, bitmask, rows)
    ones = np.ones(4)
    params = (ones * [1.0, 0.8, 1.2, 0.0], np.zeros(4, np.int64), ones * 0.95, ones * 0.0, ones * 0.37)
    expected, _ = native_sampling.run(premasked, *params)
    tokens, _ = native_sampling.run(logits, *params, mask_rows=rows, mask=bitmask)
    assert torch.equal(logits, premasked)  # masked in place, the other rows untouched
    assert tokens.tolist() == expected.tolist()
    for i, row in enumerate(rows):
        assert (int(bitmask[i, tokens[row] // 32]) >> (tokens[row] % 32)) & 1


def test_masks_from_reused_buffers_reach_their_rows_in_the_c_sampler(tokenizer: PreTrainedTokenizerBase,
                                                                     grammars: Grammars) -> None:
    """The engine's masks (several rows in a MaskBuffer, or one prepared row), packed for C
    when built, mask exactly their own rows as the sampler samples them (sampled and greedy
    rows alike), step after step in the same buffer: the same tokens and logits as the rows
    masked beforehand, bit by bit, and sampled without a mask."""
    if native_sampling.library() is None:
        pytest.skip("the C sampler is not built here")
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "yz"]}, "b": {"type": "string"}},
                                    "required": ["a", "b"]}, "x")
    ids = tokenizer.encode('{"a": "yz", "b": "', add_special_tokens=False)
    matchers = [grammars.matcher(spec) for _ in range(3)]
    for advanced, matcher in enumerate(matchers):  # three states: the start, a key, a string
        for token in ids[:[0, 3, len(ids)][advanced]]:
            assert matcher.accept(token)
        matcher.prepare()
    params = [SamplingParams(temperature=0.0) if row % 2 else SamplingParams(temperature=1.0, top_p=0.9, seed=row)
              for row in range(6)]
    seeds, steps = [None if p.greedy else 7 + row for row, p in enumerate(params)], [0] * 6
    buffer = MaskBuffer()
    generator = torch.Generator().manual_seed(3)
    for constrained in ([(5, matchers[0]), (0, matchers[1]), (3, matchers[2])], [(4, matchers[2])],
                        [(1, matchers[0]), (2, matchers[1])]):
        mask = TokenMask.for_rows(constrained, grammars.vocab_size, buffer)  # type: ignore[arg-type]
        assert mask.native is not None  # packed when built, not per call
        logits = torch.randn(6, grammars.vocab_size, generator=generator) * 4
        premasked = reference_mask(logits, mask.bitmask, mask.rows)
        expected = sampler.sample(premasked.clone(), params, seeds, steps)
        assert sampler.sample(logits, params, seeds, steps, mask) == expected
        assert torch.equal(logits, premasked)


@pytest.mark.parametrize("vocab", [33, 1000])
def test_the_c_sampler_masks_the_last_partial_word(vocab: int) -> None:
    """A vocabulary that is not a multiple of 32: the last word's bits cover only its tokens."""
    if native_sampling.library() is None:
        pytest.skip("the C sampler is not built here")
    generator = torch.Generator().manual_seed(vocab)
    rows = [1, 2]
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
    bitmask[:, :-1] = -1  # only the last word forbids anything
    bitmask[:, -1] &= 0x5
    logits = torch.randn(3, vocab, generator=generator)
    logits[1:, -1] = 100.0  # the top token, forbidden unless its bit is set
    premasked = reference_mask(logits, bitmask, rows)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=3, seed=1)]
    expected = sampler.sample(premasked.clone(), params, [None, None, 5], [0, 0, 0])
    assert sampler.sample(logits, params, [None, None, 5], [0, 0, 0], TokenMask(bitmask, rows)) == expected
    assert torch.equal(logits, premasked)


def test_a_packed_mask_is_checked_against_each_calls_logits(tokenizer: PreTrainedTokenizerBase,
                                                            grammars: Grammars) -> None:
    """A mask packed once is still checked at every call, before any C: its rows against the
    logits' rows, its words against their width."""
    if native_sampling.library() is None:
        pytest.skip("the C sampler is not built here")
    matcher = grammars.matcher(GrammarSpec.regex("[0-9]+", "guided_regex"))
    matcher.prepare()
    mask = TokenMask.for_rows([(5, matcher)], grammars.vocab_size, MaskBuffer())
    ones = np.ones(2)
    params = (ones, np.zeros(2, np.int64), ones, ones * 0.0, ones * 0.5)
    logits = torch.randn(2, grammars.vocab_size)
    before = logits.clone()
    with pytest.raises(ValueError, match="masked rows"):
        native_sampling.run(logits, *params, mask=mask.native_mask())
    with pytest.raises(ValueError, match="int32"):
        native_sampling.run(torch.randn(6, 1000), *(np.ones(6) * p[0] for p in params), mask=mask.native_mask())
    assert torch.equal(logits, before)


def test_one_spec_compiled_at_once_is_shared_but_a_failure_is_each_requests_own(grammars: Grammars) -> None:
    """Three requests with one new spec at once: one compile, every request served. Three with
    one spec that cannot compile: the first's refusal is cached and answers the others, each
    error naming that request's own parameter, and nothing is left in flight."""
    compiles = GrammarCompiles()

    async def together(spec: GrammarSpec, params: tuple[str, ...]) -> dict[str, str | None]:
        outcome: dict[str, str | None] = {}

        async def one(param: str) -> None:
            try:
                await compiles.compile(grammars, spec, param, "tenant")
                outcome[param] = None
            except GrammarError as error:
                outcome[param] = error.param

        async with anyio.create_task_group() as group:
            for param in params:
                group.start_soon(one, param)
        return outcome

    before = grammars.compiles
    good = GrammarSpec.json_schema({"type": "object", "properties": {"shared": {"type": "integer"}}}, "x")
    assert anyio.run(together, good, ("a", "b", "c")) == {"a": None, "b": None, "c": None}
    assert grammars.compiles - before == 1
    bad = GrammarSpec.ebnf("root ::= rule_of_this_test", "guided_grammar")  # refused nowhere else
    assert anyio.run(together, bad, ("a", "b", "c")) == {"a": "a", "b": "b", "c": "c"}
    assert grammars.compiles - before == 2
    assert not compiles._in_flight


def test_a_request_queued_for_a_slot_takes_its_specs_compile_once_another_request_starts_it(
        grammars: Grammars) -> None:
    """One tenant's slot is held; S, then a slow Y, then S again queue for it. Once the first S
    gets the slot and starts compiling, the second S leaves the queue and waits for that
    compile: it is answered with the first, not after Y's compile (its turn)."""
    compiles = GrammarCompiles(slots=1)
    same = GrammarSpec.json_schema({"type": "object", "properties": {"queued_same": {"type": "integer"}}}, "x")
    slow = GrammarSpec.json_schema({"type": "object", "properties": {
        "queued_slow": {"type": "string", "pattern": "^.{0,1024}$"}}}, "x")
    done: list[str] = []

    async def run() -> None:
        gate = anyio.Event()

        async def hold() -> None:
            async with compiles.slots.hold("tenant"):
                await gate.wait()

        async def one(name: str, spec: GrammarSpec) -> None:
            await compiles.compile(grammars, spec, "response_format", "tenant")
            done.append(name)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as group:
                group.start_soon(hold)
                for name, spec in (("same 1", same), ("slow", slow), ("same 2", same)):
                    await anyio.sleep(0.01)  # queued in this order
                    group.start_soon(one, name, spec)
                await anyio.sleep(0.01)
                assert compiles.slots.waiting("tenant") == 3
                gate.set()

    before = grammars.compiles
    anyio.run(run)
    assert done == ["same 1", "same 2", "slow"]
    assert grammars.compiles - before == 2
    assert not compiles._in_flight and not compiles._queued


def test_a_slow_accept_counts_against_the_pace_budget_like_a_fill(grammars: Grammars, tokenizer: PreTrainedTokenizerBase,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An ambiguous grammar's accepts slow down with its fills (a third attack round: about half
    a fill each, and untimed): one past the budget ends the request at its next check, as a
    fill does. Within the budget nothing changes."""
    matcher = grammars.matcher(GrammarSpec.regex("a+", "guided_regex"))
    token = tokenizer.encode("a")[0]
    assert matcher.accept(token)
    matcher.check_pace()  # within the budget: nothing
    monkeypatch.setattr(matcher_module, "FILL_BUDGET_S", -1.0)  # every accept is over it
    assert matcher.accept(token)
    monkeypatch.undo()
    with pytest.raises(matcher_module.GrammarTooSlow, match="took over 50 ms of CPU"):
        matcher.check_pace()


def test_a_spec_compiled_twice_side_by_side_is_cached_and_counted_once(tokenizer: PreTrainedTokenizerBase,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two compiles of one spec can run at once (the waiters of a failed shared compile, two
    engines' callers): the second to finish must not count the grammar's bytes again, which
    would shrink the cache for good."""
    grammars = Grammars(tokenizer, 2048, [tokenizer.eos_token_id], compile_timeout_s=None)
    barrier = threading.Barrier(2)
    compile_or_refuse = grammars._compile_or_refuse

    def both_inside(spec: GrammarSpec) -> Any:
        barrier.wait(30)  # both missed the cache before either stores its result
        return compile_or_refuse(spec)

    monkeypatch.setattr(grammars, "_compile_or_refuse", both_inside)
    spec = GrammarSpec.choice(["yes", "no"], "guided_choice")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda _: grammars.compile(spec), range(2)))
    assert grammars.compiles == 2
    assert grammars._cache_bytes == grammars._cache[spec].memory_size_bytes > 0


def test_tokens_the_text_leaves_out_never_spell_grammar_text(tokenizer: PreTrainedTokenizerBase) -> None:
    """Special tokens are decoded away (skip_special_tokens), so the grammar must not take
    them as their text: xgrammar read none of the demo's (SmolLM2's) as special, and
    "<|im_start|>" could stand for itself in a JSON string or a choice (the reply then ended
    "stop" with text that matched nothing). The end token stays the end of a document."""
    from radixserve import Engine
    from radixserve.engine.spelling import hidden_token_ids

    grammars = Engine(model="demo", num_pages=16).grammars
    hidden = hidden_token_ids(tokenizer)
    eos = tokenizer.eos_token_id
    assert hidden - {eos}  # the case at hand: specials besides the end token
    choice = grammars.matcher(GrammarSpec.choice(["<|im_start|>", "ab"], "guided_choice"))
    assert not allowed_tokens(grammars, choice) & hidden
    string = grammars.matcher(GrammarSpec.json_schema({"type": "string"}, "x"))
    assert string.accept(tokenizer.encode('"', add_special_tokens=False)[0])
    assert not allowed_tokens(grammars, string) & hidden
    for token in tokenizer.encode('ab"', add_special_tokens=False):
        assert string.accept(token)
    assert allowed_tokens(grammars, string) == {eos}
