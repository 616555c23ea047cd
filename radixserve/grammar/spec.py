"""What a request's output must match, checked before anything is compiled.

A GrammarSpec is a small frozen value (kind + canonical source text), so it hashes: compiled
grammars are cached by it, and two requests with the same schema share one compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "ebnf"]
# JSON Schema keywords the grammar engine would silently ignore: refused, not half-honoured.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                        "unevaluatedProperties", "unevaluatedItems", "contains", "propertyNames")
MAX_SOURCE_CHARS = 64 * 1024  # a schema, regex or grammar compiles in time bounded by its size


class GrammarError(ValueError):
    """A constraint that cannot be compiled or honoured; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on the generated text: `kind` and its `source` (a JSON Schema as canonical
    JSON text, a regex, a JSON list of choices, or an EBNF grammar)."""

    kind: GrammarKind
    source: str = ""

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
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            where = "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in exc.path)
            raise GrammarError(f"{param}: invalid JSON Schema at {where or 'the top'}: {exc.message}",
                               param) from None
        path = _unsupported_keyword(schema, "")
        if path is not None:
            raise GrammarError(f"{param}: the schema keyword at {path} is not supported by radixserve's "
                               f"grammar engine (unsupported: {', '.join(UNSUPPORTED_KEYWORDS)})", param)
        # Key order is kept: properties are generated in the order the schema lists them.
        return GrammarSpec("json_schema", _bounded(json.dumps(schema), param))

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


def _bounded(source: str, param: str) -> str:
    if len(source) > MAX_SOURCE_CHARS:
        raise GrammarError(f"{param}: at most {MAX_SOURCE_CHARS} characters", param)
    return source


def _unsupported_keyword(node: Any, path: str) -> str | None:
    """The path of the first unsupported keyword used as a schema keyword under `node`."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            found = _unsupported_keyword(item, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    if not isinstance(node, dict):
        return None
    for key, value in node.items():
        if key in UNSUPPORTED_KEYWORDS:
            return f"{path}.{key}" if path else key
        # Under these, keys are names the user chose, not keywords: only their values are schemas.
        if key in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for name, sub in value.items():
                found = _unsupported_keyword(sub, f"{path}.{key}.{name}" if path else f"{key}.{name}")
                if found is not None:
                    return found
        elif key not in ("enum", "const", "default", "examples", "required"):
            found = _unsupported_keyword(value, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    return None
