"""Time to first token with and without the short-prompt lane, on several workloads.

`Scheduler._short_lane` admits a waiting prompt with at most `short_prompt_tokens` tokens left
to compute ahead of a running prompt's next chunk (`Engine(short_prompt_tokens=)`, default 128;
0 turns it off: the prompt waits for every chunk). This runs the engine's own scheduler and
cache in the simulator (benchmark/sim_server.py) with a CPU's costs — a step is 30 ms plus
1/250 s per prompt token (SmolLM2-135M on 2 cores: 5,400 prompt tokens took 26 s), 512
tokens a step, the mixed-step cap of 128 — on workloads of different shapes, each at two
loads (requests arrive as a Poisson process at `load` times the rate the server could prefill
them, from a first run's hit rate), lane off and on. Reported: TTFT mean and percentiles of
all requests, p90 of the "short" ones (at most 128 prompt tokens not cached) and p99 of the
"long" ones (the rest), the time the last request ended and the hit rate.

    python bench/short_lane.py [--loads 0.5,0.8] [--lanes 0,128] [--json out.json]

`--engine MODEL` instead runs the real engine in process: a `--long-tokens` prompt, and a
question of 8 tokens added after its first step, lane off and on (`--repeat` rounds, which
goes first alternating; every run's prompts are new): the wall time to each one's first token.

    python bench/short_lane.py --engine smollm2 --long-tokens 5400 --repeat 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from radixserve.benchmark.lengths import with_varied_prompt_lengths
from radixserve.benchmark.simulate import SimConfig, SimResult, simulate
from radixserve.benchmark.workloads import Workload, make_workload, mooncake_trace, with_poisson_arrivals

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
PREFILL_TOKENS_PER_S = 250.0
DECODE_STEP_S = 0.03
SHORT = 128  # a request is "short" with at most this many prompt tokens not cached


def workloads() -> dict[str, Workload]:
    """Each shape at a few hundred requests (their own arrival times are replaced)."""
    return {
        "gsp lognormal": with_varied_prompt_lengths(
            make_workload("gsp", num_groups=8, prompts_per_group=24, system_len=1024, question_len=128,
                          output_len=32), vocab_size=32000, distribution="lognormal"),
        "multiturn": make_workload("multiturn", num_clients=24, num_turns=5, system_len=512, output_len=48),
        "agent": make_workload("agent", num_agents=12, num_steps=8, system_len=1024, output_len=32),
        "chat-gaps": make_workload("chat-gaps", scale=0.5),
        "agent-tools": make_workload("agent-tools", scale=0.05),
        "zipf-docs": make_workload("zipf-docs", scale=0.05),
        "scan": make_workload("scan", scale=0.1),
        "mooncake 300": mooncake_trace(TRACE, limit=300),
    }


def config(lane: int) -> SimConfig:
    """A CPU-like server (module docstring); `lane` 0: the lane off."""
    return SimConfig(2_000_000, max_running=32, max_batch_tokens=512, prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
                     decode_step_s=DECODE_STEP_S, mixed_prefill_tokens=128, short_prompt_tokens=lane or None,
                     eviction_policy="lru")


def figures(result: SimResult, workload: Workload) -> dict[str, float]:
    """TTFT summary (all, short, long), the end of the run and the hit rate."""
    ttft = result.ttft_s
    uncached = np.array([r.prompt_len for r in workload.requests]) - result.per_request_hits
    done = ~np.isnan(ttft)
    short, long_ = done & (uncached <= SHORT), done & (uncached > SHORT)

    def pct(mask: np.ndarray, q: float) -> float:
        return float(np.percentile(ttft[mask], q)) if mask.any() else float("nan")

    return {"ttft_mean_s": float(ttft[done].mean()), "ttft_p50_s": pct(done, 50), "ttft_p90_s": pct(done, 90),
            "ttft_p99_s": pct(done, 99), "short_p90_s": pct(short, 90), "long_p99_s": pct(long_, 99),
            "short_share": float(short.sum() / max(done.sum(), 1)), "makespan_s": result.makespan_s,
            "hit_rate": result.hit_rate}


def engine_round(engine: object, lane: int, long_tokens: int, round_index: int,
                 short_max_tokens: int = 4) -> dict[str, float]:
    """One long prompt, then a short one after its first step; seconds to each first token."""
    import time

    from radixserve.engine.params import SamplingParams

    rng = np.random.default_rng([round_index, lane])  # new prompts every run: none cached
    vocab = min(len(engine.tokenizer), 20_000)  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.scheduler.short_prompt_tokens = lane or None  # type: ignore[attr-defined]
    started = time.perf_counter()
    ids = {engine.add_request(rng.integers(100, vocab, long_tokens).tolist(), params): "long"}  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]
    short_sent = time.perf_counter()
    short = SamplingParams(max_tokens=short_max_tokens, temperature=0.0, ignore_eos=True)
    ids[engine.add_request(rng.integers(100, vocab, 8).tolist(), short)] = "short"  # type: ignore[attr-defined]
    first: dict[str, float] = {}
    while engine.has_work():  # type: ignore[attr-defined]
        for request_id, deltas in engine.step().items():  # type: ignore[attr-defined]
            name = ids.get(request_id)
            if name and name not in first and any(d.token_ids for d in deltas):
                first[name] = time.perf_counter() - (started if name == "long" else short_sent)
    return first


def engine_main(model: str, long_tokens: int, repeat: int, short_max_tokens: int) -> None:
    """`--engine`: the real engine, lane off and on alternately (module docstring)."""
    import statistics

    from radixserve.engine.engine import Engine

    engine = Engine(model=model)
    times: dict[int, list[dict[str, float]]] = {0: [], SHORT: []}
    engine_round(engine, 0, 256, 99)  # warm-up: the first steps of a process are slower
    for round_index in range(repeat):
        for lane in list(times)[:: 1 if round_index % 2 == 0 else -1]:  # alternating which goes first
            times[lane].append(engine_round(engine, lane, long_tokens, round_index, short_max_tokens))
            print(f"round {round_index + 1}, lane {lane or 'off'}: {times[lane][-1]}", flush=True)
    print("| lane | short prompt TTFT s (median) | long prompt TTFT s (median) |\n|---|---|---|")
    for lane, rounds in times.items():
        print(f"| {lane or 'off'} | {statistics.median(r['short'] for r in rounds):.2f} "
              f"| {statistics.median(r['long'] for r in rounds):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", default="0.5,0.8", help="offered prefill loads (default: %(default)s)")
    parser.add_argument("--lanes", default="0,128", help="short_prompt_tokens values, 0: off (default: %(default)s)")
    parser.add_argument("--only", default=None, help="comma-separated workload names")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--engine", default=None, metavar="MODEL", help="run the real engine instead")
    parser.add_argument("--long-tokens", type=int, default=5400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--short-max-tokens", type=int, default=4, help="the question's reply length")
    args = parser.parse_args()
    if args.engine:
        engine_main(args.engine, args.long_tokens, args.repeat, args.short_max_tokens)
        return
    loads = [float(x) for x in args.loads.split(",")]
    lanes = [int(x) for x in args.lanes.split(",")]
    rows = []
    print("| workload | load | lane | TTFT mean s | p50 | p90 | p99 | short p90 | long p99 | short share "
          "| end s | hit rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, base in workloads().items():
        if args.only and name not in args.only.split(","):
            continue
        pilot = simulate(base, SimConfig(2_000_000, sequential=True))
        uncached = base.prompt_tokens * (1 - pilot.hit_rate) / len(base.requests)
        for load in loads:
            workload = with_poisson_arrivals(base, load * PREFILL_TOKENS_PER_S / uncached, seed=1)
            for lane in lanes:
                fig = figures(simulate(workload, config(lane)), workload)
                rows.append({"workload": name, "load": load, "lane": lane, **fig})
                print(f"| {name} | {load} | {lane or 'off'} | {fig['ttft_mean_s']:.1f} | {fig['ttft_p50_s']:.1f} "
                      f"| {fig['ttft_p90_s']:.1f} | {fig['ttft_p99_s']:.1f} | {fig['short_p90_s']:.1f} "
                      f"| {fig['long_p99_s']:.1f} | {fig['short_share']:.0%} | {fig['makespan_s']:.0f} "
                      f"| {fig['hit_rate']:.1%} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
