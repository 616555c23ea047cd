"""Clients looping an ambiguous guided_regex beside an innocent streaming client, with and
without --grammar-paced-share (engine/grammar_pace.py).

Each attacker loops a request whose regex, `((a|aa|aaa){0,100}){0,100}a{40}b`, compiles in
milliseconds and then makes each step's grammar work 1.5-2x the last until the per-fill
budget ends the request (a 400). Beside them one innocent client streams 32-token chats one
after another for `--window-s` seconds. For each setting (taking turns, `--repeats` times) a
fresh `radixserve serve`; reported per setting, each the median over the repeats: the
innocent's chats completed in the window, its token gaps (p50/p90/p99: time between stream
events, the first one after the request included), and the attackers' requests answered.
The innocent alone is the reference.

    python bench/grammar_pace.py --model smollm2 --attackers 8,32 --shares 1,0.1 --repeats 3

`--attacker-address 127.0.0.2` sends the attackers' requests from another address than the
innocent's (a server without keys shares its engine fairly between addresses); `--regex ""`
makes the attackers' requests plain chats of `--attack-max-tokens` (a flood, no grammar), and
`--innocent-regex` gives the innocent's chats a guided_regex of their own.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx
from serve_process import start_server

REGEX = "((a|aa|aaa){0,100}){0,100}a{40}b"
INNOCENT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "stream": True}


def attack_body(regex: str, max_tokens: int) -> dict:
    """The attackers' request: `regex` as a guided_regex (none: a plain chat run to max_tokens)."""
    if not regex:
        return {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
                "ignore_eos": True}
    return {"messages": [{"role": "user", "content": "Write a's."}], "max_tokens": max_tokens, "guided_regex": regex}


async def window(base: str, attackers: int, seconds: float, attack_request: dict, innocent_request: dict,
                 attacker_address: str | None) -> dict[str, float]:
    url = base + "/v1/chat/completions"
    gaps: list[float] = []
    ttfts: list[float] = []
    chats = answered = 0

    async def attack(stop: float) -> None:
        nonlocal answered
        while time.monotonic() < stop:
            await attack_client.post(url, json=attack_request)
            answered += 1

    async def innocent(client: httpx.AsyncClient, stop: float) -> None:
        nonlocal chats
        while time.monotonic() < stop:
            last = time.monotonic()
            first = True
            async with client.stream("POST", url, json=innocent_request) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.monotonic()
                        gaps.append(now - last)
                        if first:
                            ttfts.append(now - last)
                            first = False
                        last = now
            chats += 1

    limits = httpx.Limits(max_connections=attackers + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client, httpx.AsyncClient(
            timeout=600, limits=limits, transport=httpx.AsyncHTTPTransport(local_address=attacker_address, limits=limits)
            if attacker_address else None) as attack_client:
        await client.post(url, json={**innocent_request, "stream": False})  # warm up
        stop = time.monotonic() + seconds
        attacks = [asyncio.create_task(attack(stop)) for _ in range(attackers)]
        await innocent(client, stop)
        for task in attacks:  # a slow attack request still in flight is dropped (the server aborts it)
            task.cancel()
        await asyncio.gather(*attacks, return_exceptions=True)
    gaps.sort()
    at = lambda q: 1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))]  # noqa: E731
    ttft = 1000 * statistics.median(ttfts) if ttfts else float("inf")  # none: no chat began in the window
    return {"chats": chats, "ttft": ttft, "ttft_max": 1000 * max(ttfts, default=float("inf")), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "attacks": answered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--attackers", default="8,32")
    parser.add_argument("--shares", default="1,0.1", help="--grammar-paced-share values (1: no pacing)")
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--regex", default=REGEX, help="the attackers' guided_regex")
    parser.add_argument("--attack-max-tokens", type=int, default=100)
    parser.add_argument("--attacker-address", default=None, help="the attackers' source address (127.0.0.2)")
    parser.add_argument("--innocent-regex", default=None, help="a guided_regex for the innocent's chats")
    parser.add_argument("--server-flags", default="", help="more `radixserve serve` flags, e.g. '--max-running 16'")
    args = parser.parse_args()
    attack_request = attack_body(args.regex, args.attack_max_tokens)
    innocent_request = INNOCENT
    if args.innocent_regex:  # (ignore_eos is refused with a grammar: the end token closes an output)
        innocent_request = {key: value for key, value in INNOCENT.items() if key != "ignore_eos"}
        innocent_request["guided_regex"] = args.innocent_regex
    cells = [(0, 1.0)] + [(int(a), float(s)) for a in args.attackers.split(",") for s in args.shares.split(",")]
    runs: dict[tuple[int, float], list[dict[str, float]]] = {cell: [] for cell in cells}
    for _ in range(args.repeats):
        for attackers, share in cells:
            process = start_server(["--model", args.model, "--grammar-paced-share", str(share),
                                    *args.server_flags.split()], args.port)
            try:
                runs[attackers, share].append(asyncio.run(window(
                    f"http://127.0.0.1:{args.port}", attackers, args.window_s, attack_request, innocent_request,
                    args.attacker_address)))
            finally:
                process.terminate()
                process.wait(60)
    print(f"| attackers | paced share | innocent chats in {args.window_s:g} s | innocent TTFT p50 / max (ms) "
          "| token gap p50 / p90 / p99 (ms) | attack requests answered |")
    print("|---|---|---|---|---|---|")
    for attackers, share in cells:
        med = {key: statistics.median(run[key] for run in runs[attackers, share]) for key in runs[attackers, share][0]}
        label = "-" if attackers == 0 else ("1 (off)" if share >= 1 else f"{share:g}")
        print(f"| {attackers} | {label} | {med['chats']:g} | {med['ttft']:.0f} / {med['ttft_max']:.0f} | {med['p50']:.0f} / {med['p90']:.0f} / {med['p99']:.0f} "
              f"| {med['attacks']:g} |")


if __name__ == "__main__":
    main()
