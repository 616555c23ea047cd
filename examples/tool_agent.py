"""An agent that calls two local Python tools in a loop, through the official `openai` client.

The model gets two tools, `get_weather(city)` and `calculate(expression)`; whenever it answers
with tool calls, the loop runs them here and sends the results back as `role: "tool"`
messages, until the model answers in words (or `--steps` runs out). Every step resends the
whole conversation with the same tools, as agents do: the tool definitions render to the same
prompt bytes every time, so each step's prompt begins with the previous one and the prefix
cache serves it. Each step prints the cache's share of its prompt.

The first step asks for a tool call (`tool_choice: "required"`: the reply is constrained to a
well-formed call by the grammar engine), later ones leave the choice to the model ("auto").
A 135M model is no reliable agent; what it shows is the API and the cache.

    radixserve serve --model smollm2 &      # in another terminal (or any model URL)
    python examples/tool_agent.py [--url http://127.0.0.1:8000/v1] [--steps 4]
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
from typing import Any

import openai

SYSTEM_PROMPT = "You are a helpful assistant. Use the tools when they help, then answer briefly."
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluates an arithmetic expression such as '2 * (3 + 4)'.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 80}},
                       "required": ["expression"]}}},
]
WEATHER = {"paris": "light rain, 14 C", "oslo": "snow, -3 C", "cairo": "sunny, 31 C"}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.Pow: operator.pow, ast.USub: operator.neg}


def get_weather(city: str) -> str:
    """A stand-in weather service."""
    return WEATHER.get(city.strip().lower(), f"no weather station in {city!r}")


def calculate(expression: str) -> str:
    """Arithmetic only: the expression's syntax tree is walked, never eval'd."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")
    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"cannot calculate {expression!r}: {exc}"


LOCAL_TOOLS = {"get_weather": get_weather, "calculate": calculate}


def run_tool(name: str, arguments: str) -> str:
    """Runs a call the model made; bad arguments become an error message for the model."""
    try:
        return LOCAL_TOOLS[name](**json.loads(arguments))
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        return f"error: {type(exc).__name__}: {exc}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    parser.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--task", default="What is the weather in Paris, and what is 17 * 23?")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.url, api_key="unused")
    model = args.model or client.models.list().data[0].id
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": args.task}]
    for step in range(1, args.steps + 1):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice="required" if step == 1 else "auto",
            temperature=0.0, max_tokens=200)
        usage = response.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        print(f"step {step}: prompt {usage.prompt_tokens} tokens, {cached} from the cache "
              f"({cached / usage.prompt_tokens:.0%})")
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"  answer: {message.content!r}")
            break
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            print(f"  {call.function.name}({call.function.arguments}) -> {result}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


if __name__ == "__main__":
    main()
