"""Clients without keys taking turns in the running slots: one address's streams, and an
address coming back with a lead, beside forty addresses looping long chats.

`streams`: one address (127.0.0.3) opens `--streams` streamed 100-token chats; half a second
later forty addresses (127.0.0.10-49) loop 300-token chats. Reported: each stream's largest
token gap and its time in all (its client's slot is lent in turn: engine/fair_share.py).

`return`: 127.0.0.3 streams three 300-token chats beside 127.0.0.4's one of 330 tokens (nobody
waits, so 127.0.0.3's lead is service nobody else asked for); then the forty addresses begin
looping, and 3 s later 127.0.0.3 sends three 32-token chats one after another. Reported:
their times to a first token (a lead held against it made it wait until the forty caught up).

A fresh `radixserve serve --max-running 16` per scenario and repeat; run it from each checkout
to compare code (`PYTHONPATH=<checkout> python bench/client_turns.py`).

    python bench/client_turns.py --model smollm2 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
from serve_process import start_server

LOOP = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300, "ignore_eos": True}


def chat(max_tokens: int, text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}


def client(address: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=600, transport=httpx.AsyncHTTPTransport(local_address=address))


async def stream(http: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float, float]:
    """A streamed chat's time to its first token, largest gap between tokens, and time in all."""
    start = last = time.monotonic()
    first, gap = None, 0.0
    async with http.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                now = time.monotonic()
                if first is None:
                    first = now - start
                else:
                    gap = max(gap, now - last)
                last = now
    return first if first is not None else float("inf"), gap, time.monotonic() - start


async def loops(url: str, stop: asyncio.Event) -> None:
    async def loop(address: str) -> None:
        async with client(address) as http:
            while not stop.is_set():
                await stream(http, url, {**LOOP, "stream": True})
    tasks = [asyncio.create_task(loop(f"127.0.0.{10 + i}")) for i in range(40)]
    await stop.wait()
    for task in tasks:  # requests in flight are dropped (the server aborts them)
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def streams(url: str, count: int) -> str:
    stop = asyncio.Event()
    async with client("127.0.0.3") as http:
        mine = [asyncio.create_task(stream(http, url, chat(100, f"Story number {k}."))) for k in range(count)]
        await asyncio.sleep(0.5)
        background = asyncio.create_task(loops(url, stop))
        results = await asyncio.gather(*mine)
    stop.set()
    await background
    return (f"largest gaps {', '.join(f'{gap:.1f}' for _, gap, _ in results)} s; "
            f"in all {', '.join(f'{total:.1f}' for _, _, total in results)} s")


async def comeback(url: str) -> str:
    stop = asyncio.Event()
    async with client("127.0.0.3") as heavy, client("127.0.0.4") as light:
        await asyncio.gather(*[stream(heavy, url, chat(300, f"Story number {k}.")) for k in range(3)],
                             stream(light, url, chat(330, "A light story.")))
        background = asyncio.create_task(loops(url, stop))
        await asyncio.sleep(3)
        firsts = [(await stream(heavy, url, chat(32, "The capital of France is")))[0] for _ in range(3)]
    stop.set()
    await background
    return f"times to a first token {', '.join(f'{first:.1f}' for first in firsts)} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8792)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--scenarios", default="streams,return")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--serve-args", default="", help="more `radixserve serve` flags, e.g. '--tenant-starts 0'")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    for repeat in range(args.repeats):
        for scenario in args.scenarios.split(","):
            process = start_server(["--model", args.model, "--max-running", "16", *args.serve_args.split()], args.port)
            try:
                run = streams(url, args.streams) if scenario == "streams" else comeback(url)
                print(f"{scenario} (run {repeat + 1}): {asyncio.run(run)}", flush=True)
            finally:
                process.terminate()
                process.wait(60)


if __name__ == "__main__":
    main()
