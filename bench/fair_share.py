"""A flooding tenant beside an innocent one, with and without fair share (engine/fair_share.py).

    PYTHONPATH=. python bench/fair_share.py            # medians of 3 runs, ~2 min on 2 cores
    PYTHONPATH=. python bench/fair_share.py --runs 5

The flood is issue 22's request scaled down (64 prompts x n=16 x 256 tokens on a 512-page pool
becomes 16 prompts x n=8 x 64 tokens on a 160-page pool); once it runs, the innocent tenant
sends 6 short requests, one after another finishes (a chat client). A benign baseline runs
the innocent tenant beside 16 ordinary requests (n=1, 8 tokens) instead. Reported per
setting: the innocent requests' mean and worst time to first token and their total time (engine steps, and
seconds on this machine), and the innocent tenant's share of the service (weighted tokens)
while its first request was live. The model is the tests' tiny random Llama, so steps are cheap and
the figures are the scheduler's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from model_helpers import write_tiny_checkpoint  # noqa: E402

from radixserve import Engine, SamplingParams  # noqa: E402

INNOCENT = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def neighbour(engine: Engine, flood: bool) -> None:
    rng = random.Random(0)
    for i in range(16):
        params = (SamplingParams(max_tokens=64, n=8, temperature=1.0, seed=i, ignore_eos=True) if flood
                  else SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        engine.add_request([rng.randrange(3, 300) for _ in range(24)], params, tenant="neighbour")


def run(ckpt: Path, fair: bool, flood: bool) -> dict[str, float]:
    engine = Engine(model=str(ckpt), page_size=16, num_pages=160, max_running=64, max_batch_tokens=512,
                    fair_share=fair)
    neighbour(engine, flood)
    for _ in range(2):
        engine.step()
    counters = engine.scheduler.fair.counters
    start_service = {t: counters.get(t, 0.0) for t in ("neighbour", "innocent")}
    ttft_steps, ttft_s, total_steps, total_s = [], [], [], []
    for i in range(6):
        rid = engine.add_request(list(range(40 + i, 64 + i)), INNOCENT, tenant="innocent")
        steps, started, first = 0, time.perf_counter(), None
        done = False
        while not done:
            deltas = engine.step()
            steps += 1
            for delta in deltas.get(rid, []):
                if first is None:
                    first = steps
                    ttft_steps.append(steps)
                    ttft_s.append(time.perf_counter() - started)
                done = done or delta.finish_reason is not None
        total_steps.append(steps)
        total_s.append(time.perf_counter() - started)
        if i == 0:  # the share of the service while the first innocent request was live
            served = {t: counters.get(t, 0.0) - start_service[t] for t in start_service}
            share = served["innocent"] / max(1e-9, sum(served.values()))
    while engine.has_work():
        engine.step()
    return {"ttft_steps": statistics.mean(ttft_steps), "ttft_ms": 1e3 * statistics.mean(ttft_s),
            "max_ttft_steps": max(ttft_steps), "total_steps": sum(total_steps), "total_s": sum(total_s),
            "share": share, "fair_preemptions": engine.stats()["fair_preemptions"],
            "preemptions": engine.stats()["preemptions"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint("llama", Path(tmp) / "llama")
        settings = {"benign neighbour, fair share": (True, False), "flood, fair share (VTC)": (True, True),
                    "flood, one queue (--no-fair-share)": (False, True)}
        results: dict[str, list[dict[str, float]]] = {name: [] for name in settings}
        run(ckpt, True, False)  # warm-up: the first run pays for kernel builds and caches
        for _ in range(args.runs):  # alternated, so that the machine's load falls on all alike
            for name, (fair, flood) in settings.items():
                results[name].append(run(ckpt, fair, flood))
    keys = ["ttft_steps", "max_ttft_steps", "ttft_ms", "total_steps", "total_s", "share", "preemptions",
            "fair_preemptions"]
    print("| setting | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, runs in results.items():
        cells = [statistics.median(r[k] for r in runs) for k in keys]
        print(f"| {name} | " + " | ".join(f"{c:.3g}" if isinstance(c, float) else str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
