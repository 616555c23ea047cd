"""A multi-turn agent loop over radixserve: a shared system prompt and a growing conversation.

Every turn resends the whole conversation, as agents do. The prefix cache serves what earlier
turns (and other agents sharing the system prompt) already computed; the loop prints how many
prompt tokens each turn got from the cache. Each agent uses a `session_id`, which keeps its
latest turn ahead of ordinary cache until the session is closed.

    radixserve serve &                      # in another terminal
    python examples/agent_loop.py --agents 2 --turns 4
"""

from __future__ import annotations

import argparse
import os
import uuid

import httpx

SYSTEM_PROMPT = (
    "You are a careful research agent. You work in steps: think about the task, call one tool, "
    "read its result, and continue until the task is done. Tools: search(query), read(url), "
    "calculate(expression). Answer with the next tool call, or FINAL: <answer> when you are done. "
    "Be brief, cite what you read, and never invent a source. " * 3
)
TASKS = ["Find the population of the three largest cities in Norway and add them up.",
         "Compare the boiling points of water at sea level and on Mount Everest."]


def run_agent(client: httpx.Client, task: str, turns: int, max_tokens: int, agent: int) -> None:
    """Runs one agent for `turns` turns, printing its cache hits; closes its session at the end."""
    session_id = f"agent-{agent}-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
    for turn in range(1, turns + 1):
        response = client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0.7,
            "session_id": session_id, "system_retention_priority": 90})
        if response.status_code != 200:
            raise SystemExit(f"error {response.status_code}: {response.text}")
        data = response.json()
        usage = data["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        print(f"agent {agent} turn {turn}: prompt {usage['prompt_tokens']:5d} tokens, "
              f"cached {cached:5d} ({cached / usage['prompt_tokens']:6.1%})")
        reply = data["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": f"Tool result {turn}: (no results for that call). Continue."})
    client.post(f"/v1/sessions/{session_id}/close").raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    parser.add_argument("--agents", type=int, default=2, help="agents sharing the system prompt")
    parser.add_argument("--turns", type=int, default=4, help="turns per agent")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per reply at most")
    parser.add_argument("--api-key", default=os.environ.get("RADIXSERVE_API_KEY"),
                        help="the server's --api-key (default: $RADIXSERVE_API_KEY, else none)")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=300) as client:
        for agent in range(args.agents):
            run_agent(client, TASKS[agent % len(TASKS)], args.turns, args.max_tokens, agent)


if __name__ == "__main__":
    try:
        main()
    except httpx.ConnectError as exc:  # one line, not a traceback, for the usual mistake
        raise SystemExit(f"error: no server answered ({exc}); start one with `radixserve serve`, "
                         "or pass --url") from None
