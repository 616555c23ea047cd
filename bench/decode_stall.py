"""How long a decoding stream stalls when another client's long prompt arrives, per server.

One client streams a long completion; 2 s in, another sends a prompt of `--prompt-tokens`
distinct token ids (nothing of it cached) and waits for its first token. Reported per server:
the stream's longest gap between tokens and its median gap, and the long prompt's time to
first token. A server that prefills the whole prompt in the steps it decodes in stalls the
stream for the whole prefill; one that paces prefill beside decoding streams
(radixserve's `--mixed-prefill-tokens`) bounds the gap and pays in the long prompt's TTFT.

Servers must take token-id prompts at /v1/completions (radixserve and llama-server do) and
serve the same model. Rounds alternate between the servers; medians over `--repeat` rounds.
Each round's long prompt differs (a new offset), so no round hits an earlier one's cache.

    python bench/decode_stall.py --server rs=http://127.0.0.1:8101 --server llama=http://127.0.0.1:8102
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx


async def stream_gaps(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, list[float]]:
    """Streams a completion; returns (time of its first token, gaps between later tokens)."""
    gaps: list[float] = []
    first = last = None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if not choices or not choices[0].get("text"):
                continue
            now = time.perf_counter()
            if last is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    if first is None:
        raise RuntimeError(f"{url}: no token streamed")
    return first, gaps


async def one_round(url: str, prompt_tokens: int, offset: int, stream_tokens: int) -> dict[str, float]:
    """The stream, the long prompt 2 s into it, and what each saw."""
    stream = {"prompt": [1, 504, 3, 9, 12, 88], "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True}
    long_prompt = {"prompt": [100 + (offset + i * 37) % 40_000 for i in range(prompt_tokens)],
                   "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=900) as client:
        streaming = asyncio.create_task(stream_gaps(client, url, stream))
        await asyncio.sleep(2.0)
        sent = time.perf_counter()
        first, _ = await stream_gaps(client, url, long_prompt)
        _, gaps = await streaming
    return {"max_gap_s": max(gaps), "median_gap_s": statistics.median(gaps), "long_ttft_s": first - sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="name=url (repeat)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--stream-tokens", type=int, default=300, help="long enough to outlast the prefill")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    servers = dict(item.split("=", 1) for item in args.server)
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    for repeat in range(args.repeat):
        for name, url in servers.items():
            result = asyncio.run(one_round(url, args.prompt_tokens, 7919 * (repeat + 1), args.stream_tokens))
            rounds[name].append(result)
            print(f"round {repeat + 1} {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
    print(f"\nmedians of {args.repeat} rounds, a {args.prompt_tokens}-token prompt beside one stream:")
    print("| server | stream's longest gap s | stream's median gap s | long prompt's TTFT s |")
    print("|---|---|---|---|")
    for name, results in rounds.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"| {name} | {med['max_gap_s']:.2f} | {med['median_gap_s']:.3f} | {med['long_ttft_s']:.2f} |")


if __name__ == "__main__":
    main()
