"""`radixserve bench compare` and `radixserve bench tiers`: comparisons that run the bench model,
their arguments and commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from radixserve.benchmark.cli_common import (
    check_workload_args,
    interruptible,
    output_file,
    parse_workload_args,
    positive_float,
    positive_int,
    power_of_two,
    say,
    write_json,
)
from radixserve.benchmark.lengths import LENGTH_DISTRIBUTIONS
from radixserve.benchmark.report import plot_ttft_cdf, serve_table
from radixserve.benchmark.workloads import WORKLOADS, Workload, make_workload

# CPU-sized generator arguments per workload (a few hundred to a few thousand tokens per
# request, tens of requests), under --workload-args' overrides. One default for every
# workload crashed: gsp's keywords given to few_shot, multiturn's to agent_loop.
COMPARE_WORKLOAD_ARGS: dict[str, str] = {
    "gsp": "num_groups=4,prompts_per_group=8,system_len=512,question_len=64,output_len=16",
    "fewshot": "num_tasks=2,num_examples=4,example_len=128,questions_per_task=16,question_len=64,output_len=16",
    "multiturn": "num_clients=8,num_turns=4,num_system_prompts=2,system_len=256,message_len=48,output_len=16",
    "agent": "num_agents=4,num_steps=4,system_len=512,task_len=64,tool_len=128,output_len=16",
    "tools": "num_agents=4,num_steps=4,num_toolsets=2,system_len=256,tools_len=256,task_len=64,call_len=16,"
             "result_len=64",
    "gapped-chat": "num_conversations=8,max_turns=4,num_system_prompts=2,system_len=256,message_len=48,"
                   "output_len=16",
    "chat-crowd": "num_conversations=8,token_scale=0.1",
    "chat-gaps": "num_conversations=4,token_scale=0.1",
    "agent-tools": "num_agents=4,token_scale=0.1",
    "scan": "num_requests=32,token_scale=0.1",
    "zipf-docs": "num_docs=8,num_requests=32,token_scale=0.1",
}
TIERS_WORKLOAD_ARGS: dict[str, str] = {
    "multiturn": "num_clients=16,num_turns=6,num_system_prompts=2,system_len=128,message_len=48,output_len=24",
    "agent": "num_agents=8,num_steps=4,system_len=128,task_len=48,tool_len=64,output_len=24",
}


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="cache on vs off vs transformers generate, on a random bench Llama")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="gsp",
                   help="synthetic workload (default: %(default)s)")
    p.add_argument("--workload-args", default="", metavar="K=V,...",
                   help="generator overrides on top of the workload's CPU-sized defaults (for gsp: "
                        f"{COMPARE_WORKLOAD_ARGS['gsp']})")
    p.add_argument("--model-dir", type=Path, default=Path("bench/results/bench-llama"),
                   help="bench model directory, built if missing (default: %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=8,
                   help="requests in flight against each server (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="transformers static batch size")
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags, space separated "
                                                     "(--dtype and --page-size apply in process too)")
    p.add_argument("--mode", choices=["both", "in-process", "http"], default="both",
                   help="the engine in this process (no HTTP), the server over HTTP, or both "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="CPU threads of every run, in process and servers (default: torch's choice)")
    p.add_argument("--vary-output", action="store_true",
                   help="redraw output lengths around the workload's (same total; see --length-dist)")
    p.add_argument("--vary-prompt", action="store_true",
                   help="redraw the unique part of every prompt (gsp/fewshot's question) around the "
                        "workload's length, shared prefixes kept (same total; see --length-dist)")
    p.add_argument("--length-dist", choices=LENGTH_DISTRIBUTIONS, default="uniform",
                   help="distribution of varied lengths of mean m: uniform (about 1 .. 2m-1) or "
                        "lognormal (sigma 1, a ShareGPT-like long tail) (default: %(default)s)")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="rounds of every run; figures are medians, ratios are taken within a round "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    _add_run_outputs(p)
    p.set_defaults(handler=interruptible(compare_command), default_workload_args=COMPARE_WORKLOAD_ARGS)


def compare_command(args: argparse.Namespace) -> int:
    """`radixserve bench compare`."""
    from radixserve.benchmark.compare import MODES, run_comparison
    from radixserve.benchmark.lengths import with_varied_output_lengths, with_varied_prompt_lengths
    from radixserve.benchmark.inprocess import breakdown_table

    try:
        model_dir, workload, params = _bench_model_and_workload(args)
    except ValueError as error:
        say(f"error: {error}")
        return 2
    try:
        if args.vary_prompt:
            workload = with_varied_prompt_lengths(workload, params["vocab_size"], args.seed, args.length_dist)
        if args.vary_output:
            workload = with_varied_output_lengths(workload, args.seed, args.length_dist)
    except ValueError as error:  # e.g. --vary-prompt on turns that extend earlier ones
        say(f"error: {error}")
        return 2
    result = run_comparison(workload, model_dir, concurrency=args.concurrency, batch_size=args.batch_size,
                            server_args=args.server_args.split(),
                            modes=MODES if args.mode == "both" else (args.mode,), repeat=args.repeat,
                            log_dir=args.json.parent if args.json else None, progress=not args.no_progress,
                            threads=args.threads, port=args.port)
    rows = {_row_label(f"radixserve {label}", summary): summary for label, summary in result["runs"].items()}
    rows["transformers generate, static batches"] = result["hf_static_batches"]
    if args.repeat > 1:
        print(f"medians of {args.repeat} rounds; ratios taken within each round, then the median\n")
    print(serve_table(rows))
    hf = result["hf_static_batches"]
    useful = hf["prompt_tokens"] + hf["completion_tokens"]
    print(f"transformers ran {hf['computed_tokens']:.0f} token positions for {useful:.0f} useful tokens "
          f"({hf['computed_tokens'] / useful - 1:.0%} padding and tokens past a request's own length)\n")
    print("\n".join(f"{name}: {value:.2f}x" for name, value in result["ratios"].items()))
    in_process = {label: s for label, s in result["runs"].items() if label.startswith("in-process")}
    if in_process:
        print("\nEngine step time per batch step (in process), by section:\n")
        print(breakdown_table(in_process))
    failed = _report_failures(result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_ttft_cdf(result["ttft_s"], args.plot, title=f"TTFT, {workload.name}: prefix cache on vs off")
    if args.json:
        write_json(args.json, result)
    return 1 if failed else 0


def _add_tiers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tiers", help="multi-turn chat on a device pool too small for it, with and without "
                                     "the host tier, on a random bench Llama")
    p.add_argument("--workload", choices=["multiturn", "agent"], default="multiturn",
                   help="the conversation workload (default: %(default)s)")
    p.add_argument("--workload-args", default="", metavar="K=V,...",
                   help="generator overrides on top of the workload's CPU-sized defaults (for multiturn: "
                        f"{TIERS_WORKLOAD_ARGS['multiturn']})")
    p.add_argument("--device-fraction", type=positive_float, default=0.25,
                   help="device pool as a fraction of the working set (default: %(default)s)")
    p.add_argument("--host-factor", type=positive_float, default=2.0,
                   help="host tier as a multiple of the working set (default: %(default)s)")
    p.add_argument("--page-size", type=power_of_two, default=16, help="tokens per KV page (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, default=Path("bench/results/bench-llama"),
                   help="bench model directory, built if missing (default: %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=4,
                   help="conversations in flight at once (default: %(default)s)")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="runs of each server, alternating; medians are reported (default: %(default)s)")
    p.add_argument("--server-args", default="", help="extra `radixserve serve` flags, space separated")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    _add_run_outputs(p)
    p.set_defaults(handler=interruptible(tiers_command), default_workload_args=TIERS_WORKLOAD_ARGS)


def tiers_command(args: argparse.Namespace) -> int:
    """`radixserve bench tiers`."""
    from radixserve.benchmark.host_tier import run_host_tier_comparison

    try:
        model_dir, workload, _ = _bench_model_and_workload(args)
    except ValueError as error:
        say(f"error: {error}")
        return 2
    result = run_host_tier_comparison(workload, model_dir, page_size=args.page_size,
                                      device_fraction=args.device_fraction, host_factor=args.host_factor,
                                      concurrency=args.concurrency, repeat=args.repeat,
                                      server_args=args.server_args.split(),
                                      log_dir=args.json.parent if args.json else None,
                                      progress=not args.no_progress, port=args.port)
    say(f"working set {result['working_set_tokens']} tokens: device pool {result['device_pages']} pages, "
         f"host tier {result['host_pages']} pages of {args.page_size}")
    print(serve_table({_row_label(label, summary): summary
                       for label, summary in result["servers"].items()}))  # medians of the runs
    for name, value in result.get("ratios", {}).items():
        if value is not None:
            print(f"{name}: {value:.2f}x")
    if "identical_outputs" in result:
        print(f"identical outputs: {result['identical_outputs']} ({result['mismatched_requests']} differ)")
        copy, prefill = result["copy_s_per_token"], result["prefill_s_per_token"]
        if copy and prefill:
            print(f"copy from host: {1e6 * copy:.2f} us/token; prefill: {1e6 * prefill:.2f} us/token")
    failed = _report_failures(result)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_ttft_cdf(result["ttft_s"], args.plot, title=f"TTFT, {workload.name}: device pool "
                                                         f"{args.device_fraction:g} of the working set")
    if args.json:
        write_json(args.json, result)
    return 1 if failed else 0


def _report_failures(result: dict) -> bool:
    """Says on stderr which server runs failed and which runs did other work than
    transformers (compare only); True if any did."""
    for label, reason in result["server_failures"].items():
        say(f"server run '{label}' failed: {reason}")
    for label, reason in result.get("request_failures", {}).items():
        say(f"run '{label}': {reason}")
    mismatches = result.get("token_mismatches", {})
    for label, reason in mismatches.items():
        say(f"run '{label}' did not do the same work as transformers: {reason}")
    return bool(result["server_failures"] or mismatches or result.get("request_failures"))


def _row_label(label: str, summary: dict) -> str:
    """`label`, marked where requests of the run failed (its figures cover the rest only)."""
    if not summary.get("errors"):
        return label
    return f"{label} (FAILED: {summary.get('completed', 0):.0f} of {summary.get('requests', 0):.0f} completed)"


def _add_run_outputs(p: argparse.ArgumentParser) -> None:
    """The output flags compare and tiers share."""
    p.add_argument("--json", type=output_file, help="write the results here")
    p.add_argument("--plot", type=output_file, help="write the TTFT distribution (PNG) here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--port", type=int, default=None,
                   help="local port the benchmark's servers listen on, one at a time (default: a free one)")


def workload_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The generator arguments of compare/tiers: the workload's defaults, then
    `--workload-args`; ValueError on a malformed item or a keyword the generator lacks."""
    overrides = {**parse_workload_args(args.default_workload_args.get(args.workload, "")),
                 **parse_workload_args(args.workload_args)}
    check_workload_args(args.workload, overrides)
    return overrides


def _bench_model_and_workload(args: argparse.Namespace) -> tuple[Path, Workload, dict[str, Any]]:
    """The bench model (built if missing), the workload over its vocabulary, and the
    workload's parameters. ValueError for arguments the generator refuses."""
    from radixserve.benchmark.compare import build_bench_model, model_vocab_size

    overrides = workload_overrides(args)  # before building the model: a bad flag fails at once
    model_dir = build_bench_model(args.model_dir)
    params = {"seed": args.seed, "vocab_size": model_vocab_size(model_dir), **overrides}
    try:
        return model_dir, make_workload(args.workload, **params), params
    except (TypeError, ValueError) as error:  # e.g. a count given as 2.5 or a length as 'abc'
        raise ValueError(f"--workload-args {args.workload_args!r}: {error}") from error
