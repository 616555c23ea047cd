"""One tenant's many streams beside another tenant's short chats, at several --tenant-step-rows.

For each setting (taking turns, `--repeats` times) a fresh `radixserve serve` with two keys;
the flood key streams 8 requests of n=16 long generations (128 streams); once they decode,
the other key sends 16-token chats one after another for `--window-s` seconds. Reported per
setting: the chats' median and max latency, and the tokens per second of the whole server
over the window (from /metrics), each the median over the repeats; and the chats alone.

    python bench/tenant_step_share.py --model smollm2 --rows 0,32,16 --repeats 3
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import threading
import time

import httpx
from serve_process import start_server

KEYS = "kflood flood;kok ok"
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
FLOOD = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}], "n": 16,
         "max_tokens": 4000, "temperature": 1, "ignore_eos": True, "stream": True}


def serve(model: str, port: int, rows: int | None) -> subprocess.Popen:
    """A server on `port` (None: no flood will run, so the limit does not matter)."""
    flags = ["--model", model, "--kv-memory-gb", "4"]
    if rows is not None:
        flags += ["--tenant-step-rows", str(rows)]
    return start_server(flags, port, env={"RADIXSERVE_API_KEYS": KEYS})


def generated(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return float(re.search(r"^radixserve_generated_tokens_total(?:\{[^}]*\})? (\S+)", text, re.M).group(1))


def chats(base: str, window_s: float) -> list[float]:
    latencies = []
    with httpx.Client(timeout=600, headers={"Authorization": "Bearer kok"}) as client:
        started = time.time()
        while time.time() - started < window_s:
            sent = time.time()
            client.post(base + "/v1/chat/completions", json=CHAT).raise_for_status()
            latencies.append(time.time() - sent)
    return latencies


def run(model: str, port: int, rows: int, window_s: float) -> tuple[float, float, float]:
    """(median chat s, max chat s, server tok/s) with the flood running."""
    process = serve(model, port, rows)
    base = f"http://127.0.0.1:{port}"
    stop = threading.Event()

    def flood(seed: int) -> None:
        with httpx.Client(timeout=3600, headers={"Authorization": "Bearer kflood"}) as client:
            try:
                with client.stream("POST", base + "/v1/chat/completions", json={**FLOOD, "seed": seed}) as response:
                    for _ in response.iter_bytes():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass

    try:
        for seed in range(8):
            threading.Thread(target=flood, args=(seed,), daemon=True).start()
        time.sleep(20)  # the prompts are in; the 128 streams decode
        tokens, started = generated(base), time.time()
        latencies = chats(base, window_s)
        rate = (generated(base) - tokens) / (time.time() - started)
        return statistics.median(latencies), max(latencies), rate
    finally:
        stop.set()
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", default="0,32,16", help="--tenant-step-rows settings (0: no limit)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=60.0)
    parser.add_argument("--port", type=int, default=8231)
    args = parser.parse_args()
    process = serve(args.model, args.port, None)
    try:
        alone = statistics.median(chats(f"http://127.0.0.1:{args.port}", 10.0))
    finally:
        process.terminate()
        process.wait(30)
    print(f"chats alone: median {alone:.2f} s")
    settings = [int(r) for r in args.rows.split(",")]
    results: dict[int, list[tuple[float, float, float]]] = {rows: [] for rows in settings}
    for _ in range(args.repeats):
        for rows in settings:  # taking turns, so that the machine's load falls on each alike
            results[rows].append(run(args.model, args.port, rows, args.window_s))
            print(f"  rows {rows}: {results[rows][-1]}", flush=True)
    print("| --tenant-step-rows | chat median | chat max | all tokens |")
    print("|---|---|---|---|")
    for rows in settings:
        median, worst, rate = (statistics.median(r[i] for r in results[rows]) for i in range(3))
        print(f"| {rows} | {median:.2f} s | {worst:.2f} s | {rate:.0f} tok/s |")


if __name__ == "__main__":
    main()
