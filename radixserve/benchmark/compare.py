"""Cache on vs off vs Hugging Face `generate`: the same requests on a bench-size random Llama.

`build_bench_model` writes a random Llama of tens of millions of parameters (large enough that
compute, not Python, dominates) with transformers' `save_pretrained`, plus the demo's BPE
tokenizer. `run_comparison` serves it twice with `radixserve serve` (prefix cache on, then
`--no-prefix-cache`), replays the workload against each over HTTP, then runs transformers'
`generate` on the same prompts in static batches, and reports throughput and latency ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from radixserve.benchmark.serve import run_serve_benchmark
from radixserve.benchmark.workloads import Workload

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def launch_server(model_dir: str | Path, extra_args: list[str], *, log_path: Path | None = None
                  ) -> Iterator[str]:
    """Runs `radixserve serve` on a free local port until the block exits; yields its URL."""
    port = _free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", str(model_dir),
           "--port", str(port), "--log-level", "warning", *extra_args]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
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
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()


@dataclass
class StaticBatchResult:
    """transformers `generate` over the workload in fixed batches."""

    duration_s: float
    latency_s: list[float]
    prompt_tokens: int
    output_tokens: int

    def summary(self) -> dict[str, float]:
        """Throughput and latency figures, named like `ServeResult.summary`'s."""
        latency = np.array(self.latency_s)
        return {
            "duration_s": self.duration_s, "requests": len(self.latency_s),
            "request_throughput": len(self.latency_s) / self.duration_s,
            "output_token_throughput": self.output_tokens / self.duration_s,
            "total_token_throughput": (self.prompt_tokens + self.output_tokens) / self.duration_s,
            "latency_mean_s": float(latency.mean()), "latency_p99_s": float(np.percentile(latency, 99)),
        }


def hf_static_batches(model_dir: str | Path, workload: Workload, batch_size: int = 8) -> StaticBatchResult:
    """Greedy `generate` in batches of `batch_size` requests (left-padded, every request
    forced to its full output length); a request's latency is its batch's finish time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    pad = int(model.config.pad_token_id or 0)
    requests = workload.requests
    latency: list[float] = []
    output_tokens = 0
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
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        output_tokens += sum(max(r.output_len, 1) for r in batch)
        latency += [time.perf_counter() - start] * len(batch)
    return StaticBatchResult(time.perf_counter() - start, latency, workload.prompt_tokens, output_tokens)


SERVER_RUNS: tuple[tuple[str, list[str], bool], ...] = (
    # (label, extra `radixserve serve` flags, isolate requests with their own cache_salt)
    ("cache on", [], False),
    ("cache off", ["--no-prefix-cache"], False),
    ("cache on, 0% reuse", [], True),
)


def run_comparison(workload: Workload, model_dir: str | Path, *, concurrency: int = 8,
                   batch_size: int = 8, server_args: list[str] | None = None,
                   log_dir: Path | None = None, progress: bool = False) -> dict[str, object]:
    """Serves `model_dir` three ways (prefix cache on; off with `--no-prefix-cache`; on, but
    every request under its own cache_salt, i.e. caching's overhead at 0% hits), replays
    `workload` against each, runs the transformers static-batch baseline, and returns
    summaries plus ratios. A server that fails to start is reported, not fatal."""
    summaries: dict[str, dict] = {}
    ttfts: dict[str, list[float]] = {}
    failures: dict[str, str] = {}
    for label, flags, isolate in SERVER_RUNS:
        log_path = log_dir / f"server-{label.replace(' ', '-').replace(',', '').replace('%', 'pct')}.log" \
            if log_dir else None
        try:
            with launch_server(model_dir, [*(server_args or []), *flags], log_path=log_path) as url:
                result = asyncio.run(run_serve_benchmark(url, workload, concurrency=concurrency,
                                                         isolate=isolate, progress=progress))
        except (RuntimeError, TimeoutError) as exc:
            failures[label] = str(exc)
            continue
        summaries[label] = result.summary()
        ttfts[label] = [r.ttft_s for r in result.records if r.error is None]
    hf = hf_static_batches(model_dir, workload, batch_size).summary()
    ratios: dict[str, float] = {}
    on = summaries.get("cache on")
    for label, summary in summaries.items():
        if on is not None and label != "cache on":
            ratios[f"throughput: cache on / {label}"] = on["total_token_throughput"] / summary["total_token_throughput"]
            ratios[f"ttft mean: {label} / cache on"] = summary["ttft_mean_s"] / on["ttft_mean_s"]
        ratios[f"throughput: {label} / transformers"] = summary["total_token_throughput"] / hf["total_token_throughput"]
    if on is not None:
        ratios["latency mean: transformers / cache on"] = hf["latency_mean_s"] / on["latency_mean_s"]
    return {
        "workload": workload.name, "workload_params": workload.params, "requests": len(workload.requests),
        "prompt_tokens": workload.prompt_tokens, "concurrency": concurrency, "hf_batch_size": batch_size,
        "servers": summaries, "server_failures": failures, "hf_static_batches": hf, "ttft_s": ttfts,
        "ratios": ratios,
    }
