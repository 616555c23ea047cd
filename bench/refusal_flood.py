"""A flood of cheap requests beside an innocent client, with and without the pacing of refused
addresses (server/refusal_pacing.py).

The attacker (a process of its own, from 127.0.0.2) loops `--loops` requests: with `--flood
refused`, requests whose `guided_regex` does not compile (a 400, found among the refused specs
after the first); with `--flood valid`, one-token chats; with `--flood batch`, 64-token chats
(a legitimate batch client, to see what sharing the server costs it). Beside it the innocent
streams 32-token chats one after another from 127.0.0.1 for `--window-s` seconds. For each
`--refusals-per-s` and `--tenant-starts` value, a fresh `radixserve serve`: the innocent's
chats alone and beside the flood, its median time to a first token, the attacker's answers,
and the server's and the attacker's CPU seconds over the window.

    python bench/refusal_flood.py --model smollm2 --rates 0,10 --repeats 2
    python bench/refusal_flood.py --flood valid --rates 10 --tenant-starts 0,4 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import httpx
from serve_process import start_server

FLOODS = {
    # A 400, found among the refused specs after the first.
    "refused": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "guided_regex": "(a"},
    # A valid request as cheap as one can be: a one-token answer to a one-character prompt.
    "valid": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    # Not an attack: a batch client's 64-token answers, to see what sharing costs it.
    "batch": {"messages": [{"role": "user", "content": "Write a poem."}], "max_tokens": 64, "ignore_eos": True},
}
INNOCENT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True, "stream": True}


def cpu_s(pid: int) -> float:
    """A process's CPU seconds, its threads' included (/proc/PID/stat: utime + stime)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def attack(url: str, loops: int, seconds: float, flood: str) -> None:
    """The attacker's process: `loops` loops of the `flood` request; prints its answers and CPU."""
    stop = time.monotonic() + seconds
    answered = 0

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal answered
        while time.monotonic() < stop:
            await client.post(url, json=FLOODS[flood])
            answered += 1

    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2", limits=httpx.Limits(max_connections=loops))
    async with httpx.AsyncClient(timeout=120, transport=transport) as client:
        await asyncio.gather(*[loop(client) for _ in range(loops)])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"answered": answered, "cpu_s": usage.ru_utime + usage.ru_stime}))


async def innocent(url: str, seconds: float, loops: int, flood: str) -> dict[str, float]:
    """The innocent's chats in the window, beside an attacker process when `loops`."""
    stop = time.monotonic() + seconds
    attacker = subprocess.Popen([sys.executable, __file__, "--attack", url, str(loops), str(seconds), flood],
                                stdout=subprocess.PIPE, text=True) if loops else None
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=120) as client:
        while time.monotonic() < stop:
            start, first = time.monotonic(), None
            async with client.stream("POST", url, json=INNOCENT) as response:
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.monotonic() - start
            ttfts.append(first if first is not None else float("inf"))
    flood = json.loads(attacker.communicate()[0]) if attacker else {"answered": 0, "cpu_s": 0.0}
    return {"chats": len(ttfts), "ttft_ms": 1000 * statistics.median(ttfts), "attacker_answered": flood["answered"],
            "attacker_cpu_s": flood["cpu_s"]}


def main() -> None:
    if sys.argv[1:2] == ["--attack"]:
        asyncio.run(attack(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8793)
    parser.add_argument("--rates", default="0,10", help="--refusals-per-s values (0: no pacing)")
    parser.add_argument("--loops", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--flood", choices=sorted(FLOODS), default="refused",
                        help="the attacker's request: refused (a 400), valid (a one-token chat) or batch (64 tokens)")
    parser.add_argument("--serve-args", default="", help="more `radixserve serve` flags, e.g. '--tenant-step-rows 16'")
    parser.add_argument("--tenant-starts", default="",
                        help="--tenant-starts values to compare, e.g. 0,8 (default: the server's default)")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    print("| --refusals-per-s | --tenant-starts | attacker loops | innocent chats | TTFT p50 (ms) "
          "| attacker answered | server CPU s | attacker CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    starts_values = args.tenant_starts.split(",") if args.tenant_starts else ["default"]
    for _ in range(args.repeats):
        for rate, starts in itertools.product(args.rates.split(","), starts_values):
            flags = [] if starts == "default" else ["--tenant-starts", starts]
            command = ["--model", args.model, "--refusals-per-s", rate, *flags, *args.serve_args.split()]
            process = start_server(command, args.port)
            try:
                httpx.post(url, json={**INNOCENT, "stream": False}, timeout=120)  # warm up
                for loops in (0, args.loops):
                    before = cpu_s(process.pid)
                    run = asyncio.run(innocent(url, args.window_s, loops, args.flood))
                    print(f"| {rate} | {starts} | {loops} | {run['chats']} | {run['ttft_ms']:.0f} "
                          f"| {run['attacker_answered']} | {cpu_s(process.pid) - before:.1f} "
                          f"| {run['attacker_cpu_s']:.1f} |", flush=True)
            finally:
                process.terminate()
                process.wait(60)


if __name__ == "__main__":
    main()
