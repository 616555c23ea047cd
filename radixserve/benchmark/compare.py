"""Cache on vs off vs Hugging Face `generate`: the same requests on a bench-size random Llama.

`build_bench_model` writes a random Llama of tens of millions of parameters (large enough that
compute, not Python, dominates) with transformers' `save_pretrained`, plus the demo's BPE
tokenizer. `run_comparison` runs the workload with the prefix cache on, off, and on with
nothing reusable, each through `Engine` in process (no HTTP: the engine alone) and through
`radixserve serve` over HTTP (the engine plus the server), then transformers' `generate` on
the same prompts in static batches, and reports throughput and latency ratios (medians of
ratios taken side by side, over `repeat` rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from radixserve.benchmark.inprocess import run_in_process
from radixserve.benchmark.serve import ServeResult, run_serve_benchmark
from radixserve.benchmark.workloads import Workload
from radixserve.engine.engine import Engine
from radixserve.ports import free_port

SERVER_START_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class BenchModelSpec:
    """Shape of the random benchmark Llama (defaults: about 28M parameters)."""

    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 4
    vocab_size: int = 4096
    max_positions: int = 8192
    seed: int = 0


def build_bench_model(directory: str | Path, spec: BenchModelSpec = BenchModelSpec()) -> Path:
    """Writes config.json, model.safetensors and tokenizer files of a random Llama to
    `directory` (skipped if a checkpoint is already there); returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from radixserve.models.demo import build_tokenizer

    path = Path(directory)
    if (path / "model.safetensors").is_file():
        return path
    tokenizer = build_tokenizer(spec.vocab_size, max_length=spec.max_positions)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_positions,
        tie_word_embeddings=False, bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def model_vocab_size(directory: str | Path) -> int:
    """The vocabulary size in a checkpoint's config.json (workload token ids stay below it)."""
    import json

    return int(json.loads((Path(directory) / "config.json").read_text())["vocab_size"])


@contextlib.contextmanager
def launch_server(model_dir: str | Path, extra_args: list[str], *, log_path: Path | None = None,
                  threads: int | None = None, port: int | None = None) -> Iterator[str]:
    """Runs `radixserve serve` on local `port` (default: a free one) until the block exits;
    yields its URL. `threads`: the server's CPU threads (OMP_NUM_THREADS), default torch's
    choice."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(model_dir),
           "--port", str(port), "--log-level", "warning", *extra_args]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    # The benchmark's own servers take no API key, even where RADIXSERVE_API_KEY is set.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RADIXSERVE_API_KEY", "RADIXSERVE_API_KEYS", "RADIXSERVE_ADMIN_API_KEY")}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    # Before the server exists: a SIGTERM from here on runs the `finally` below.
    restore = _exit_on_termination()
    try:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    except BaseException:
        restore()
        raise
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy after {SERVER_START_TIMEOUT_S:.0f} s")
            time.sleep(0.5)
        yield url
    finally:
        _ignore_termination()  # a second SIGTERM must not cut the cleanup short
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()
        restore()


TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)


def _raise_system_exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # the status a shell reports for death by that signal


def _exit_on_termination() -> Callable[[], None]:
    """Makes SIGTERM and SIGHUP raise SystemExit while a server runs; returns what restores the
    previous handlers. Python's default handlers end the process without running `finally`,
    so `timeout`, a CI cancel or `kill PID` left the launched server running, orphaned (Ctrl-C
    already raised KeyboardInterrupt). Signal handlers can only be set from the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.signal(sig, _raise_system_exit) for sig in TERMINATING_SIGNALS}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore


def _ignore_termination() -> None:
    """Ignores SIGTERM and SIGHUP (main thread only) until `_exit_on_termination`'s restore."""
    if threading.current_thread() is threading.main_thread():
        for sig in TERMINATING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


@dataclass
class StaticBatchResult:
    """transformers `generate` over the workload in fixed batches. `prompt_tokens` and
    `output_tokens` are the useful tokens (each request's own prompt and output length, as
    the engine counts them); `computed_tokens` the positions the batches ran, padding and
    tokens past a request's own length included (what static batching wastes)."""

    duration_s: float
    latency_s: list[float]
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int = 0

    def summary(self) -> dict[str, float]:
        """Throughput and latency figures, named like `ServeResult.summary`'s."""
        latency = np.array(self.latency_s)
        return {
            "duration_s": self.duration_s, "requests": len(self.latency_s),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.output_tokens,
            "computed_tokens": self.computed_tokens,
            "request_throughput": len(self.latency_s) / self.duration_s,
            "output_token_throughput": self.output_tokens / self.duration_s,
            "total_token_throughput": (self.prompt_tokens + self.output_tokens) / self.duration_s,
            "latency_mean_s": float(latency.mean()), "latency_p99_s": float(np.percentile(latency, 99)),
            # every request is queued at t=0: its latency is already from the run's start
            "latency_from_start_mean_s": float(latency.mean()),
        }


def hf_static_batches(model_dir: str | Path, workload: Workload, batch_size: int = 8, *,
                      dtype: str = "float32", device: str | None = None) -> StaticBatchResult:
    """Greedy `generate` in batches of `batch_size` requests, in workload order: left-padded
    to the batch's longest prompt, every row generating the batch's longest output (as a
    static batch runs until its last request finishes). Throughput counts each request's own
    prompt and output tokens only. A request's latency is its batch's finish time. Runs on
    `device` (default: CUDA when available, as the engine) in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    pad = int(model.config.pad_token_id or 0)
    requests = workload.requests
    latency: list[float] = []
    output_tokens = computed_tokens = 0
    start = time.perf_counter()
    for lo in range(0, len(requests), batch_size):
        batch = requests[lo:lo + batch_size]
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - r.prompt_len:] = torch.from_numpy(r.prompt_ids.astype(np.int64))
            mask[row, width - r.prompt_len:] = 1
        new_tokens = max(max(r.output_len for r in batch), 1)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        if device != "cpu":
            torch.cuda.synchronize()
        output_tokens += sum(max(r.output_len, 1) for r in batch)
        computed_tokens += len(batch) * (width + new_tokens)
        latency += [time.perf_counter() - start] * len(batch)
    return StaticBatchResult(time.perf_counter() - start, latency, workload.prompt_tokens, output_tokens,
                             computed_tokens)


RUNS: tuple[tuple[str, bool, bool], ...] = (
    # (label, prefix cache on, isolate requests with their own cache_salt)
    ("cache on", True, False),
    ("cache off", False, False),
    ("cache on, 0% reuse", True, True),
)
MODES = ("in-process", "http")


def run_comparison(workload: Workload, model_dir: str | Path, *, concurrency: int = 8,
                   batch_size: int = 8, server_args: list[str] | None = None,
                   modes: tuple[str, ...] = MODES, repeat: int = 1, log_dir: Path | None = None,
                   progress: bool = False, threads: int | None = None,
                   port: int | None = None) -> dict[str, object]:
    """Runs `workload` on `model_dir` three ways (prefix cache on; off; on but every request
    under its own cache_salt, i.e. caching's overhead at 0% hits) in each of `modes`
    ("in-process": `Engine` in this process, no HTTP; "http": `radixserve serve` in a
    subprocess, replayed over HTTP) and through transformers' static batches, `repeat` times
    in turn. Returns the median of every figure over the repeats, and ratios taken side by
    side within each repeat, then their median. `threads` fixes the CPU threads of every run
    (torch in this process, OMP_NUM_THREADS for the servers): on a machine shared with other
    work, one thread each keeps a busy neighbour from stalling a run's thread barriers. A
    server that fails to start is reported, not fatal; so is a run whose useful tokens (its
    completed requests' prompt and output tokens) differ from transformers' (failed or cut
    requests: its ratios would compare different work), under "token_mismatches"."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    per_repeat: list[dict[str, dict]] = []
    failures: dict[str, str] = {}
    mismatches: dict[str, str] = {}
    request_failures: dict[str, str] = {}  # run -> how many requests failed and the commonest error
    ttfts: dict[str, list[float]] = {}
    for _ in range(repeat):
        hf = hf_static_batches(model_dir, workload, batch_size,
                               dtype=str(_engine_args(server_args).get("dtype", "float32")))
        summaries: dict[str, dict] = {"transformers": hf.summary()}
        for label, prefix_cache, isolate in RUNS:
            if "in-process" in modes:
                engine = Engine(str(model_dir), enable_prefix_cache=prefix_cache, **_engine_args(server_args))
                run = run_in_process(engine, workload, concurrency=concurrency, isolate=isolate)
                del engine
                summaries[f"in-process, {label}"] = run.summary()
                # every round's, as the other figures are medians of every round
                ttfts.setdefault(f"in-process, {label}", []).extend(r.ttft_s for r in run.result.records)
            if "http" in modes:
                flags = [*(server_args or []), *([] if prefix_cache else ["--no-prefix-cache"])]
                name = f"http, {label}"
                log_path = log_dir / f"server-{_slug(label)}.log" if log_dir else None
                try:
                    with launch_server(model_dir, flags, log_path=log_path, threads=threads, port=port) as url:
                        result = asyncio.run(run_serve_benchmark(url, workload, concurrency=concurrency,
                                                                 isolate=isolate, progress=progress))
                except (RuntimeError, TimeoutError) as exc:
                    failures[name] = str(exc)
                    continue
                summaries[name] = result.summary()
                ttfts.setdefault(name, []).extend(r.ttft_s for r in result.records if r.error is None)
                if (why := failed_requests(result)) is not None:
                    request_failures[name] = why
        for name, summary in summaries.items():
            if (problem := token_mismatch(summary, summaries["transformers"])) is not None:
                mismatches[name] = problem
        per_repeat.append(summaries)
    # Every label of any round: a server that failed to start in round 1 only still has a row.
    labels = dict.fromkeys(label for summaries in per_repeat for label in summaries)
    medians = {label: median_summary([s[label] for s in per_repeat if label in s]) for label in labels}
    ratios = _median_ratios(per_repeat)
    hf = medians.pop("transformers")
    return {
        "workload": workload.name, "workload_params": workload.params, "requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens, "concurrency": concurrency, "hf_batch_size": batch_size,
        "modes": list(modes), "repeat": repeat, "runs": medians, "server_failures": failures,
        "token_mismatches": mismatches, "request_failures": request_failures,
        "hf_static_batches": hf, "ttft_s": ttfts, "ratios": ratios, "per_repeat": per_repeat,
    }


def failed_requests(result: ServeResult) -> str | None:
    """'N of M requests failed, e.g. ERROR' for a run with failed requests, else None."""
    errors = result.errors()
    if not errors:
        return None
    failed = sum(count for _, count in errors)
    return f"{failed} of {len(result.records)} requests failed, e.g. {errors[0][0]}"


def token_mismatch(run: dict, baseline: dict) -> str | None:
    """Why `run`'s token counts differ from `baseline`'s (both `summary()` dicts), or None:
    throughput ratios are only fair over the same useful tokens."""
    got = (run.get("prompt_tokens"), run.get("completion_tokens"))
    want = (baseline["prompt_tokens"], baseline["completion_tokens"])
    if got == want:
        return None
    return f"prompt/output tokens {got[0]}/{got[1]}, transformers {want[0]}/{want[1]}"


def _engine_args(server_args: list[str] | None) -> dict[str, object]:
    """The `Engine` keywords among the server flags that matter in process (--dtype,
    --page-size)."""
    args = list(server_args or [])
    out: dict[str, object] = {}
    for flag, key, cast in (("--dtype", "dtype", str), ("--page-size", "page_size", int)):
        if flag in args and args.index(flag) + 1 < len(args):
            out[key] = cast(args[args.index(flag) + 1])
    return out


def _slug(label: str) -> str:
    return label.replace(" ", "-").replace(",", "").replace("%", "pct")


def median_summary(summaries: list[dict]) -> dict:
    """Key by key over every run's keys, the median of the runs' figures: numbers (a run
    without one, e.g. no latency because it completed nothing, left out), and each number of
    a nested dict (the step breakdown); the first run's value otherwise."""
    out: dict = {}
    for key in dict.fromkeys(k for s in summaries for k in s):
        values = [s[key] for s in summaries if s.get(key) is not None]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if numbers:
            out[key] = float(np.median(numbers))
        elif values and all(isinstance(v, dict) for v in values):
            out[key] = {k: float(np.median([v[k] for v in values if k in v])) for k in values[0]}
        else:
            out[key] = values[0] if values else next(s[key] for s in summaries if key in s)
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """`numerator / denominator`, or None where either is missing or the denominator is 0 (a
    run that completed nothing has no latency and 0 tok/s: no ratio, not a crash)."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _median_ratios(per_repeat: list[dict[str, dict]]) -> dict[str, float]:
    """Throughput against transformers and cache on against the rest, per mode: computed
    within each repeat (side by side on a shared machine), then the median. A ratio with a
    side that completed nothing is left out of its round (the failure is reported apart)."""
    collected: dict[str, list[float]] = {}

    def add(name: str, value: float | None) -> None:
        if value is not None:
            collected.setdefault(name, []).append(value)

    for summaries in per_repeat:
        hf = summaries["transformers"]
        for label, summary in summaries.items():
            if label == "transformers":
                continue
            mode, _, run = label.partition(", ")
            add(f"throughput: {label} / transformers",
                ratio(summary["total_token_throughput"], hf["total_token_throughput"]))
            on = summaries.get(f"{mode}, cache on")
            if on is not None and run != "cache on":
                add(f"throughput: {mode}, cache on / {run}",
                    ratio(on["total_token_throughput"], summary["total_token_throughput"]))
            if run == "cache on":
                # Both sides from the run's start, queueing included: transformers' latency is
                # its batch's finish time, and every engine request is queued at t=0 too. The
                # engine's latency_mean_s (from the send) left out the time queued behind
                # --concurrency and made a slower engine look several times "faster".
                add(f"latency mean from the run's start: transformers / {label}",
                    ratio(hf["latency_from_start_mean_s"], summary.get("latency_from_start_mean_s")))
    return {name: float(np.median(values)) for name, values in collected.items()}
