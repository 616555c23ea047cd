"""JSON that arrives as text: request fields that hold JSON in a string (a tool call's
arguments in the history, a schema given as text) and the tool calls a model writes.

The request body itself is decoded by msgspec, which bounds its nesting and refuses lone
surrogates; JSON inside one of its strings is not, so it gets the same care here."""

from __future__ import annotations

import json
import math
from typing import Any

# Deeper than any tool call or schema; and what is nested is recursed into again later (a chat
# template's `tojson` takes about two frames a level): the interpreter's limit (1,000 frames,
# shared with the caller's own) is no bound to parse up to.
MAX_DEPTH = 128


def parse_json_text(text: str) -> Any:
    """`text` parsed as JSON; a ValueError for anything the server could not use: text that is
    not JSON, nested more than MAX_DEPTH levels, an integer past Python's 4,300-digit
    conversion limit, a lone surrogate (`"\\ud800"`), which no tokenizer can encode (a
    prompt rendered from it would fail far from the field that caused it), or a number JSON
    has no way to write: `NaN`, `Infinity` (Python reads both) or one too large for a float
    (`1e999`); written back out they would be `NaN` and `Infinity`, which no JSON parser of a
    client reads (a tool call's arguments are written back out)."""
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        too_deep = _depth(value) > MAX_DEPTH
    except RecursionError:
        too_deep = True
    if too_deep:
        raise ValueError(f"nested too deeply (more than {MAX_DEPTH} levels)")
    json.dumps(value, ensure_ascii=False).encode("utf-8")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:32]} is too large for a number")
    return value


def _depth(value: Any) -> int:
    """How deeply arrays and objects nest in `value` (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest
