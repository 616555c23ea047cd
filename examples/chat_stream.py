"""Stream a chat completion from a radixserve server and print tokens as they arrive.

    radixserve serve &                      # in another terminal
    python examples/chat_stream.py "Tell me about radix trees"
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import httpx


def stream_chat(url: str, messages: list[dict[str, str]], *, max_tokens: int, temperature: float,
                api_key: str | None) -> dict | None:
    """Prints the reply as it streams; returns the final `usage` object."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"error {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue  # the blank lines between events
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise SystemExit(f"\nserver error: {chunk['error']['message']}")
            for choice in chunk["choices"]:
                print(choice["delta"].get("content", ""), end="", flush=True)
                if choice.get("finish_reason"):
                    print(f"\n[finish_reason: {choice['finish_reason']}]")
            usage = chunk.get("usage") or usage
    return usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt", nargs="?", default="Explain prefix caching in one paragraph.",
                        help="the user message")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--system", default="You are a concise assistant.", help="system prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                        help="the server's --api-key (default: $RADIXSERVE_API_KEY, else none)")
    args = parser.parse_args()
    messages = [{"role": "system", "content": args.system}, {"role": "user", "content": args.prompt}]
    usage = stream_chat(args.url, messages, max_tokens=args.max_tokens, temperature=args.temperature,
                        api_key=args.api_key)
    if usage:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        print(f"[prompt {usage['prompt_tokens']} tokens, {cached} from cache; "
              f"completion {usage['completion_tokens']} tokens]", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except httpx.ConnectError as exc:  # one line, not a traceback, for the usual mistake
        raise SystemExit(f"error: no server answered ({exc}); start one with `radixserve serve`, "
                         "or pass --url") from None
