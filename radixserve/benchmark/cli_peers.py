"""`radixserve bench peers`: its arguments, the command and its tables."""

from __future__ import annotations

import argparse
import asyncio
import math
import secrets

from radixserve.benchmark.cli_common import (
    add_api_key_arg,
    interruptible,
    output_file,
    positive_float,
    positive_int,
    say,
    write_json,
)
from radixserve.benchmark.peer_workloads import WORKLOAD_NAMES, build_workloads


def _add_peers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("peers", help="the same chat workloads against several OpenAI-compatible servers",
                       description="Drive several OpenAI-compatible servers (radixserve, llama-server, ...) "
                                   "with one client and one set of chat workloads, alternating servers "
                                   "between repeats; prints per server the run of median wall time, the "
                                   "failed requests and ratios to the first server over the requests both "
                                   "completed.")
    p.add_argument("--server", action="append", required=True, metavar="NAME=URL",
                   help="a server to drive (repeat the flag; the first is the baseline of the ratios)")
    p.add_argument("--workloads", default="shared,multiturn,agent,distinct,single",
                   help=f"comma-separated, from: {', '.join(WORKLOAD_NAMES)} (default: %(default)s)")
    p.add_argument("--repeat", type=positive_int, default=3, help="alternating runs per workload (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=64, help="requests per workload (default: %(default)s)")
    p.add_argument("--concurrency", type=positive_int, default=16, help="conversations in flight (default: %(default)s)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens each reply has (default: %(default)s)")
    p.add_argument("--system-chars", type=positive_int, default=4500,
                   help="characters of the shared system prompt, about 1,000 tokens (default: %(default)s)")
    p.add_argument("--prompt-chars", type=positive_int, default=2200,
                   help="characters of each distinct prompt, about 500 tokens (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name to put in requests")
    add_api_key_arg(p, "every server")
    p.add_argument("--render-with", default=None, metavar="MODEL",
                   help="render every chat request in the client with radixserve's chat renderer for MODEL's "
                        "tokenizer (e.g. smollm2) and send the token ids to each server's /v1/completions: "
                        "every server then prefills the same tokens, whatever its own template does with tools")
    p.add_argument("--timeout-s", type=positive_float, default=900.0, help="per-request timeout (default: %(default)s)")
    p.add_argument("--json", type=output_file, help="write every run and the summary here")
    p.set_defaults(handler=interruptible(peers_command))


def parse_servers(items: list[str]) -> dict[str, str]:
    """['a=http://x', ...] -> {'a': 'http://x'}; ValueError on a malformed or repeated name."""
    servers: dict[str, str] = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server: expected NAME=http://HOST:PORT, got {item!r}")
        if name in servers:
            raise ValueError(f"--server: {name!r} given twice")
        servers[name] = url
    return servers


def shared_urls(servers: dict[str, str]) -> list[str]:
    """The names whose URL an earlier name has (same server: its runs find the earlier
    one's prompts cached), trailing slashes ignored."""
    seen: set[str] = set()
    shared = []
    for name, url in servers.items():
        if url.rstrip("/") in seen:
            shared.append(name)
        seen.add(url.rstrip("/"))
    return shared


def peers_command(args: argparse.Namespace) -> int:
    """`radixserve bench peers`."""
    from radixserve.benchmark.peers import TokenRenderer, ratios, run_peers, summarise

    try:
        servers = parse_servers(args.server)
        names = [w.strip() for w in args.workloads.split(",") if w.strip()]
        # A nonce per invocation: a fixed tag ("run 1") let a second `bench peers` against the
        # same long-running servers find the first invocation's prompts in radixserve's radix
        # cache (warm), while llama-server's per-slot cache keeps little: biased ratios.
        nonce = secrets.token_hex(4)
        tags = [f"run {r + 1} {nonce}" for r in range(args.repeat)]
        per_repeat = [build_workloads(names, requests=args.requests, concurrency=args.concurrency,
                                      system_chars=args.system_chars, prompt_chars=args.prompt_chars,
                                      run_tag=tag) for tag in tags]
    except ValueError as exc:
        say(f"error: {exc}")
        return 2

    if shared := shared_urls(servers):
        # The second name on one URL finds the first one's prompts cached (same server).
        say(f"warning: {', '.join(shared)} share a URL with an earlier --server: their runs find the "
            "earlier one's prompts cached")

    def progress(run) -> None:  # noqa: ANN001 - a RunRecord
        f = run.figures()
        say(f"  {run.workload:<9} {run.server:<14} repeat {run.repeat + 1}: {f['wall_s']:.1f} s, "
            f"{f['output_tok_s']:.1f} tok/s, TTFT p50 {f['ttft_p50_s']:.2f} s"
            + (f", {int(f['errors'])} errors" if f["errors"] else ""))

    render = TokenRenderer(args.render_with) if args.render_with else None
    runs, unreachable = asyncio.run(run_peers(servers, per_repeat, max_tokens=args.max_tokens, model=args.model,
                                              timeout_s=args.timeout_s, on_run=progress, render=render,
                                              api_key=args.api_key))
    for name, error in unreachable.items():
        say(f"{name} ({servers[name]}) not measured: {error}")
    summary = summarise(runs)
    baseline = next(iter(servers))
    relative = ratios(runs, baseline)
    print(peers_table(summary, relative, baseline, unreachable, workloads=names))
    if args.json:
        write_json(args.json, {
            "servers": servers, "run_tags": tags, "rendered_with": args.render_with, "unreachable": unreachable, "summary": summary,
            "ratios_to": baseline, "ratios": relative,
            "runs": [{"server": r.server, "workload": r.workload, "repeat": r.repeat, **r.figures()}
                     for r in runs],
        })
    failed = sum(t.error is not None for r in runs for t in r.turns)
    if failed or unreachable:
        errors = sorted({t.error for r in runs for t in r.turns if t.error})
        say("FAILED: " + "; ".join(filter(None, [
            f"{len(unreachable)} of {len(servers)} servers not measured" if unreachable else "",
            f"{failed} requests failed, e.g. {errors[0]}" if failed else ""])))
        return 1
    return 0


def _fmt(value: float, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if math.isnan(value) else f"{value * scale:.{digits}f}"


def peers_table(summary: dict[str, dict[str, dict[str, float]]],
                relative: dict[str, dict[str, dict[str, float]]], baseline: str,
                unreachable: dict[str, str] | None = None, workloads: list[str] | None = None) -> str:
    """A markdown table: one row per workload and server, the figures of one run (the median
    repeat by wall time: `summarise`), ratios to `baseline` (`ratios`) and the failed
    requests of all the repeats;
    a server of `unreachable` (name -> why it was not measured) has a row per workload of
    `workloads` (default: the summary's) saying why."""
    lines = [
        "| workload | server | run | wall s | out tok/s | TTFT p50 s | TTFT p90 s | ITL p50 ms | ITL p99 ms "
        "| decode ms/tok | cached | tok/s ratio | TTFT p50 ratio | TTFT p90 ratio | errors (all repeats) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload in dict.fromkeys([*(workloads or []), *summary]):
        for server, error in (unreachable or {}).items():
            lines.append(f"| {workload} | {server} |" + " - |" * 12 + f" not measured: {_cell(error)} |")
        for server, f in summary.get(workload, {}).items():
            r = relative.get(workload, {}).get(server, {})
            ratio = (lambda key: _fmt(r.get(key, float("nan"))) + "x" if key in r else "-")
            lines.append(
                f"| {workload} | {server} | {int(f['repeat']) + 1} | {_fmt(f['wall_s'], digits=1)} | {_fmt(f['output_tok_s'], digits=1)} "
                f"| {_fmt(f['ttft_p50_s'])} | {_fmt(f['ttft_p90_s'])} | {_fmt(f['itl_p50_s'], 1000, 1)} "
                f"| {_fmt(f['itl_p99_s'], 1000, 1)} | {_fmt(f['decode_ms_per_token'], digits=1)} "
                f"| {_fmt(f['cached_share'], 100, 1)}% | {ratio('output_tok_s') if server != baseline else '1.00x'} "
                f"| {ratio('ttft_p50_s') if server != baseline else '1.00x'} "
                f"| {ratio('ttft_p90_s') if server != baseline else '1.00x'} | {int(f['errors_all_repeats'])} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """`text` on one line of a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")
