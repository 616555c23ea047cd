"""JSON that arrives as text: request fields that hold JSON in a string (a tool call's
arguments in the history, a schema given as text) and the tool calls a model writes.

The request body itself is decoded by msgspec, which bounds its nesting and refuses lone
surrogates; JSON inside one of its strings is not, so it gets the same care here."""

from __future__ import annotations

import json
from typing import Any


def parse_json_text(text: str) -> Any:
    """`text` parsed as JSON; a ValueError for anything the server could not use: text that is
    not JSON, nesting past the interpreter's recursion limit, an integer past Python's
    4,300-digit conversion limit, or a lone surrogate (`"\\ud800"`), which no tokenizer can
    encode (a prompt rendered from it would fail far from the field that caused it)."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise ValueError("nested too deeply") from None
    return value
