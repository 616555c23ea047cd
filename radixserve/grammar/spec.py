"""What a request's output must match, checked before anything is compiled.

A GrammarSpec is a small frozen value (kind + canonical source text), so it hashes: compiled
grammars are cached by it, and two requests with the same schema share one compilation.
"""

from __future__ import annotations

import json
import math
import re
import urllib.parse
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from radixserve.schema_check import schema_problem

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf", "tool_calls"]
# JSON Schema keywords the grammar engine would silently ignore: refused, not half-honoured.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                        "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames")
MAX_SOURCE_CHARS = 64 * 1024  # a schema, regex or grammar compiles in time bounded by its size
# xgrammar 0.2.9's JSON Schema converter takes time quadratic in a `pattern`'s counted
# repetitions, up to an automaton size it gives up at (`.{0,4000}`: ~5 s of CPU, `.{0,8000}`:
# ~26 s), for each pattern in turn (patternProperties' keys alike), in a thread nobody can stop:
# a 64 KiB schema of a thousand such patterns would take hours, far from what the size bound
# above suggests. The repetitions of all the schema's patterns together, each counted bound
# times its atom's length, are bounded instead (`.{0,2048}` converts in about 1.5 s).
MAX_PATTERN_REPETITION = 2048
# Its compile time is quadratic in an object's optional properties too (each may be present or
# not, in order: 256 take 0.4 s, 800 take 3.2 s, 2,000 about a minute, and 64 KiB holds 6,000),
# and adds up over the schema's objects. The squares of the objects' optional-property counts
# are bounded together: 2**17 is one object of 362 (about 0.7 s), or 145 objects of 30.
MAX_OPTIONAL_COST = 2**17
_COUNTED = re.compile(r"\{(\d*)(,?)(\d*)\}")
_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYWORDS = ("enum", "const", "default", "examples")
_COMBINATORS = ("allOf", "anyOf", "oneOf")
# Without a `type`, xgrammar takes an object from `properties` (and the like), an array from
# `items`, a value from enum / const / $ref / a combinator, and otherwise any JSON value,
# ignoring these constraints of one type's values (`{"minimum": 5}` allowed 1).
_TYPE_GIVERS = frozenset({"enum", "const", "$ref", *_COMBINATORS, "properties", "additionalProperties",
                          "patternProperties", "items", "prefixItems"})
_TYPED_CONSTRAINTS = ("required", "minProperties", "maxProperties", "minimum", "maximum", "exclusiveMinimum",
                      "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "minItems", "maxItems")
# Keywords that constrain nothing (and `$defs`, schemas only referenced): beside a combinator
# they lose nothing when the engine follows the combinator alone (pydantic writes
# `{"allOf": [{"$ref": ...}], "description": ...}`, and `discriminator` beside oneOf).
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor", "$dynamicAnchor", "$defs", "definitions",
                          "discriminator"})


class GrammarError(ValueError):
    """A constraint that cannot be compiled or honoured; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text: `kind` and its `source` (a JSON Schema as canonical
    JSON text, a regex, a JSON list of choices, or an EBNF grammar), and the `scope` that may
    share its compiled grammar (`Grammars` caches by the whole spec).

    The server scopes each request's spec to its tenant and cache salt, as it scopes the prefix
    cache: a compile that one tenant's earlier request left in the cache answers in a fraction
    of a fresh compile's time, so a shared cache would let another tenant test guesses of its
    schemas (an enum's secret values) by timing. Within a scope, specs are shared."""

    kind: GrammarKind
    source: str = ""
    scope: Hashable = None

    @staticmethod
    def json_object() -> GrammarSpec:
        """Any JSON object."""
        return GrammarSpec("json_object")

    @staticmethod
    def json_schema(schema: Any, param: str) -> GrammarSpec:
        """A value valid under `schema`; GrammarError (naming `param` and the path inside it)
        for a schema that is not valid JSON Schema or uses a keyword the engine ignores."""
        if schema is True:
            schema = {}
        if schema is False:
            raise GrammarError(f"{param}: the schema false accepts no value", param)
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: a JSON Schema must be an object", param)
        # Key order is kept: properties are generated in the order the schema lists them. The
        # size first: checking a schema costs time in proportion to it (a megabyte, seconds).
        source = _bounded(json.dumps(schema), param)
        problem = schema_problem(schema, source)  # a large one in a child process, off the server's GIL
        if problem is not None and problem.kind == "nested":  # (its callers answer a RecursionError)
            raise RecursionError(problem.message)
        if problem is not None:
            raise GrammarError(problem.describe(param), param)
        path = _unsupported_keyword(schema, "")
        if path is not None:
            raise GrammarError(f"{param}: the schema keyword at {path} is not supported by radixserve's "
                               f"grammar engine (unsupported: {', '.join(UNSUPPORTED_KEYWORDS)})", param)
        repetition = sum(_repetition(pattern) for pattern in _patterns(schema))
        if repetition > MAX_PATTERN_REPETITION:
            raise GrammarError(f"{param}: the schema's patterns repeat too much: their counted repetitions "
                               f"({{m,n}}, each bound times the length of what it repeats) add up to "
                               f"{repetition}, at most {MAX_PATTERN_REPETITION}", param)
        optional = _optional_cost(schema)
        if optional > MAX_OPTIONAL_COST:
            raise GrammarError(f"{param}: the schema's objects have too many optional properties: the squares "
                               f"of their counts add up to {optional}, at most {MAX_OPTIONAL_COST} (one object "
                               f"of {math.isqrt(MAX_OPTIONAL_COST)}); list more of them in `required`", param)
        for node, where in _schema_nodes(schema, ""):
            problem = _half_honoured(node) or _unresolved_reference(node, schema)
            if problem is not None:
                raise GrammarError(f"{param}: at {where or 'the top'}: {problem}", param)
        if any(_fractional_integer_bounds(node) for node, _ in _schema_nodes(schema, "")):
            source = json.dumps(_whole_integer_bounds(json.loads(source)))
        return GrammarSpec("json_schema", source)

    @staticmethod
    def regex(pattern: str, param: str) -> GrammarSpec:
        """Text that the regular expression matches whole."""
        return GrammarSpec("regex", _bounded(pattern, param))

    @staticmethod
    def choice(options: list[str], param: str) -> GrammarSpec:
        """Exactly one of `options`."""
        if not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError(f"{param}: must be a non-empty list of non-empty strings", param)
        return GrammarSpec("choice", _bounded(json.dumps(options), param))

    @staticmethod
    def ebnf(grammar: str, param: str) -> GrammarSpec:
        """Text that the EBNF (GBNF-style, root rule `root`) grammar derives."""
        return GrammarSpec("ebnf", _bounded(grammar, param))

    @staticmethod
    def tool_calls(tools: list[tuple[str, GrammarSpec | None]], parallel: bool, param: str,
                   answer: GrammarSpec | None = None, call_format: str = "hermes") -> GrammarSpec:
        """Calls of `tools`, each by name with arguments valid under its schema (a json_schema
        spec) or any JSON object (None); with `parallel` False, one call at most. Without an
        `answer`: free text whose tool-call blocks (Hermes: `<tool_call>` JSON `</tool_call>`)
        are such calls. With one: either the answer (any other spec but tool_calls) or a reply
        that opens with such calls (Hermes blocks, text allowed after them; in `call_format`
        "llama3", `{"name": ..., "parameters": ...}` objects separated by "; ")."""
        plan: dict[str, Any] = {"tools": [[name, None if spec is None else json.loads(spec.source)]
                                          for name, spec in tools], "parallel": parallel}
        if answer is not None:
            if answer.kind == "tool_calls":
                raise ValueError("an answer beside tool calls cannot be tool calls itself")
            plan["answer"] = [answer.kind, answer.source]
        if call_format != "hermes":
            plan["format"] = call_format
        return GrammarSpec("tool_calls", _bounded(json.dumps(plan), param))


def _bounded(source: str, param: str) -> str:
    if len(source) > MAX_SOURCE_CHARS:
        raise GrammarError(f"{param}: at most {MAX_SOURCE_CHARS} characters", param)
    return source


def _unsupported_keyword(node: Any, path: str) -> str | None:
    """The path of the first unsupported keyword used as a schema keyword under `node`."""
    for schema, where in _schema_nodes(node, path):
        for key in schema:
            if key in UNSUPPORTED_KEYWORDS:
                return f"{where}.{key}" if where else key
    return None


def _schema_nodes(node: Any, path: str = "") -> Iterator[tuple[dict[str, Any], str]]:
    """Every schema object of a schema (itself included) with its path, in document order.
    Under `properties`, `$defs` and the like the keys are names a user chose (a property may
    be called `default`), and only the values are schemas; the values of `enum`, `const`,
    `default`, `examples` and `required` are data. A stack, not recursion: a schema may nest
    deeper than Python's recursion limit."""
    stack: list[tuple[Any, str]] = [(node, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed([(sub, f"{where}[{i}]") for i, sub in enumerate(item)]))
            continue
        if not isinstance(item, dict):
            continue
        yield item, where
        children: list[tuple[Any, str]] = []
        for key, value in item.items():
            inner = f"{where}.{key}" if where else key
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                children.extend((sub, f"{inner}.{name}") for name, sub in value.items())
            elif key not in (*_DATA_KEYWORDS, "required"):
                children.append((value, inner))
        stack.extend(reversed(children))


def _half_honoured(node: dict[str, Any]) -> str | None:
    """Why the grammar engine would generate values this schema object refuses, or None.
    xgrammar follows a combinator (allOf, anyOf, oneOf) alone, dropping every keyword beside it
    (`{"type": "object", "required": ["city"], "allOf": [{}]}` became any JSON value), keeps
    none of several allOf schemas' constraints together, takes `enum` / `const` values
    whatever the `type` beside them, and ignores constraints without a type it can infer.
    (It does not keep `uniqueItems` either; that is let through, documented: pydantic writes
    it for every set field, whose parsing drops repeats anyway.)"""
    reference = node.get("$ref")
    if isinstance(reference, str) and not reference.startswith("#"):
        # xgrammar fetches nothing: it took such a schema for any JSON value. (Nor may a
        # server fetch what a request points it at.)
        return (f"$ref {json.dumps(reference)[:80]} points outside the schema: only references within it "
                "(#/$defs/...) are followed; include the referenced schema under $defs")
    combinators = [key for key in _COMBINATORS if key in node]
    if combinators:
        beside = sorted(key for key in node if key not in _ANNOTATIONS and key != combinators[0])
        if beside:
            return (f"{combinators[0]} beside {', '.join(beside)}: the grammar engine would follow "
                    f"{combinators[0]} alone; move them into each of its schemas")
        branches = node[combinators[0]]
        if combinators[0] == "allOf" and isinstance(branches, list) and len(branches) > 1:
            return "allOf of several schemas is not supported by the grammar engine; merge them into one schema"
    declared = node.get("type")
    if declared is not None and ("enum" in node or "const" in node):
        types = declared if isinstance(declared, list) else [declared]
        values = node["enum"] if "enum" in node else [node["const"]]
        for value in values if isinstance(values, list) else []:
            if not any(_is_of_type(value, t) for t in types):
                return (f"the value {json.dumps(value)[:64]} of enum/const is not of type {json.dumps(declared)}: "
                        "no output may take it, but the grammar engine would generate it")
    types = declared if isinstance(declared, list) else [declared]
    if "multipleOf" in node and "number" in types:
        # xgrammar keeps multipleOf for integers only: {"multipleOf": 0.5} gave 5.996446
        return ('multipleOf on type "number": the grammar engine keeps it for integers only; use type '
                '"integer" (scaled) or drop it')
    if declared is None and not any(key in node for key in _TYPE_GIVERS):
        untyped = [key for key in node if key in _TYPED_CONSTRAINTS]
        if untyped:
            return (f"{', '.join(untyped)} without a type: the grammar engine would ignore "
                    f"{'it' if len(untyped) == 1 else 'them'} (any JSON value); add the type they constrain")
    return None


def _unresolved_reference(node: dict[str, Any], root: dict[str, Any]) -> str | None:
    """Why a reference within the schema would not be followed, or None. xgrammar follows
    JSON pointers ("#/$defs/X"): one that points at nothing failed the compile (a 400 naming
    the compiler's source file, and only once a tool_choice compiled the tool's schema); a
    named anchor ("#x") it took for any JSON value. An empty `enum` failed alike: refused here,
    whatever constrains the reply."""
    if node.get("enum") == []:
        return "enum [] allows no value"
    reference = node.get("$ref")
    if not isinstance(reference, str) or not reference.startswith("#") or reference == "#":
        return None
    shown = json.dumps(reference)[:80]
    if not reference.startswith("#/"):
        return f"$ref {shown} names an anchor: only JSON pointers (#/$defs/...) are followed"
    target: Any = root
    for part in reference[2:].split("/"):
        key = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and key in target:
            target = target[key]
        elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
            target = target[int(key)]
        else:
            return f"$ref {shown} points at nothing in the schema"
    return None


_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
_UPPER_BOUNDS = ("maximum", "exclusiveMaximum")


def _fractional_integer_bounds(node: dict[str, Any]) -> list[str]:
    """The bounds of an integers-only schema object that are not whole numbers (minimum 1.5)."""
    declared = node.get("type")
    types = declared if isinstance(declared, list) else [declared]
    if "integer" not in types or "number" in types:
        return []
    return [key for key in (*_LOWER_BOUNDS, *_UPPER_BOUNDS)
            if isinstance(node.get(key), float) and not node[key].is_integer()]


def _whole_integer_bounds(schema: Any) -> Any:
    """`schema` (a copy the caller owns) with every integer bound that is not a whole number
    rounded to the whole one that allows the same integers: xgrammar refuses a fractional one
    ("Integer constraint must be a whole number": a 400 for a valid schema). minimum 1.5 and
    exclusiveMinimum 1.5 both allow 2 and up (minimum 2); maximum 2.5 and exclusiveMaximum 2.5,
    2 and down (maximum 2)."""
    for node, _ in _schema_nodes(schema, ""):
        for key in _fractional_integer_bounds(node):
            bound = node.pop(key)
            if key in _LOWER_BOUNDS:
                node["minimum"] = max(math.ceil(bound), node.get("minimum", -math.inf))
            else:
                node["maximum"] = min(math.floor(bound), node.get("maximum", math.inf))
    return schema


def _is_of_type(value: Any, name: str) -> bool:
    """Whether a JSON value is of the JSON Schema type `name` (1.0 is an integer, true is not)."""
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or \
            (isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"string": str, "boolean": bool, "object": dict, "array": list}
    if name == "null":
        return value is None
    return isinstance(value, kinds[name]) if name in kinds else True


def _patterns(node: Any) -> list[str]:
    """The regular expressions of a schema: `pattern` values and `patternProperties` keys."""
    found: list[str] = []
    for item, _ in _schema_nodes(node):
        pattern, keyed = item.get("pattern"), item.get("patternProperties")
        if isinstance(pattern, str):
            found.append(pattern)
        if isinstance(keyed, dict):
            found.extend(name for name in keyed if isinstance(name, str))
    return found


def _optional_cost(node: Any) -> int:
    """The sum, over the schema's objects (`properties`), of the square of how many of their
    properties are not `required`."""
    total = 0
    for item, _ in _schema_nodes(node):
        properties, required = item.get("properties"), item.get("required")
        if isinstance(properties, dict):
            names = required if isinstance(required, list) else []
            total += (len(properties) - len(properties.keys() & {r for r in names if isinstance(r, str)})) ** 2
    return total


def _repetition(pattern: str) -> int:
    """The counted repetitions of a regular expression: for each `{m}`, `{m,}` or `{m,n}`, its
    largest bound times the length of the atom it repeats (a group counts its source's length,
    a character, class or escape 1). A cost bound, not a parser: it over-counts, never under."""
    total = 0
    groups: list[int] = []  # where the open groups start
    atom: int | None = None  # where the atom a quantifier would repeat starts, in `pattern`
    weight = 1  # that atom's length
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            atom, weight, i = i, 1, i + 2
            continue
        if char == "[":
            j = i + 1
            if j < len(pattern) and pattern[j] == "^":
                j += 1
            if j < len(pattern) and pattern[j] == "]":
                j += 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            atom, weight, i = i, 1, j + 1
            continue
        if char == "(":
            groups.append(i)
            atom, i = None, i + 1
            continue
        if char == ")":
            start = groups.pop() if groups else 0
            atom, weight, i = start, i + 1 - start, i + 1
            continue
        counted = _COUNTED.match(pattern, i) if char == "{" else None
        if counted is not None and (counted.group(1) or counted.group(3)):
            bound = max((int(d) if len(d) <= 9 else 10**9) for d in (counted.group(1) or "0", counted.group(3) or "0"))
            total += bound * (weight if atom is not None else 1)
            i = counted.end()
            continue
        atom, weight, i = (None, 1, i + 1) if char == "|" else (i, 1, i + 1)
    return total
