"""A chat or completions request's output constraint → one GrammarSpec (or None).

Sources, at most one per request: `response_format` (OpenAI's "json_object" and
"json_schema"), vLLM's extensions (`guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`, or one `structured_outputs` object), and a chat request's `tool_choice`
"required" or named (tools.py builds that spec). Errors are 400s naming the field.
"""

from __future__ import annotations

from typing import Any

from radixserve.grammar import GrammarError, GrammarSpec
from radixserve.server.errors import APIError
from radixserve.server.json_text import parse_json_text
from radixserve.server.protocol import GenerationRequest


def requested_grammar(request: GenerationRequest) -> tuple[GrammarSpec, str] | None:
    """The spec the request's own fields ask for and the field it came from; None for none."""
    found: list[tuple[GrammarSpec, str]] = []
    try:
        response_format = request.response_format
        if response_format is not None and response_format.type != "text":
            found.append(_response_format(request))
        for field, value in _extension_fields(request):
            if value is not None:
                found.append((_extension(field, value), field))
    except GrammarError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from None
    if len(found) > 1:
        raise APIError(400, f"{found[1][1]}: one output constraint per request (also given: {found[0][1]})",
                       param=found[1][1], code="invalid_value")
    return found[0] if found else None


def grammar_error(exc: GrammarError) -> APIError:
    """A grammar that does not compile: a 400 naming its field."""
    return APIError(400, str(exc), param=exc.param, code="invalid_value")


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """GrammarSpec.json_schema for a request's schema; a 400 naming `param` for one it refuses,
    and for one nested too deeply to check (the JSON Schema validator recurses once per level:
    a RecursionError, not a bug of the server)."""
    try:
        return GrammarSpec.json_schema(schema, param)
    except GrammarError as exc:
        raise grammar_error(exc) from None
    except RecursionError:
        raise APIError(400, f"{param}: the schema is nested too deeply", param=param, code="invalid_value") from None


def _response_format(request: GenerationRequest) -> tuple[GrammarSpec, str]:
    response_format = request.response_format
    assert response_format is not None
    if response_format.type == "json_object":
        return GrammarSpec.json_object(), "response_format"
    if response_format.type == "json_schema":
        param = "response_format.json_schema"
        if response_format.json_schema is None:
            raise GrammarError(f"{param}: required with type json_schema", param)
        if response_format.json_schema.schema is None:
            raise GrammarError(f"{param}.schema: required with type json_schema", f"{param}.schema")
        return json_schema_spec(response_format.json_schema.schema, f"{param}.schema"), f"{param}.schema"
    raise APIError(400, f"response_format type {response_format.type[:64]!r} is not supported; use text, "
                        "json_object or json_schema", param="response_format.type", code="unsupported_parameter")


def carries_constraint(request: GenerationRequest) -> bool:
    """Whether the request asks for an output constraint (whose check may take time: a JSON
    Schema's, in proportion to its size); a cheap look at its fields, nothing checked."""
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        return True
    return any(value is not None for _, value in _extension_fields(request))


def _extension_fields(request: GenerationRequest) -> list[tuple[str, Any]]:
    fields = [(name, getattr(request, name))
              for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")]
    outputs = request.structured_outputs
    if outputs is not None:
        fields += [(f"structured_outputs.{name}", getattr(outputs, name))
                   for name in ("json", "regex", "choice", "grammar")]
    return fields


def _extension(field: str, value: Any) -> GrammarSpec:
    kind = field.rpartition("_")[2] if field.startswith("guided_") else field.rpartition(".")[2]
    if kind == "json":
        if isinstance(value, str):
            try:
                value = parse_json_text(value)
            except ValueError as exc:
                raise GrammarError(f"{field}: not valid JSON: {exc}", field) from None
        return json_schema_spec(value, field)
    if kind == "regex":
        return GrammarSpec.regex(value, field)
    if kind == "choice":
        return GrammarSpec.choice(value, field)
    return GrammarSpec.ebnf(value, field)
