"""Where a step of the real model goes, per op, prefill and decode apart (issue 26).

Loads `--model` (default smollm2) in `--dtype`, then for each batch size runs `batch`
requests of about `--prompt-tokens` tokens of real text through `Engine.step`: the prefill
steps are timed apart from the decode steps. Two views per batch size:

- the engine's step sections (`Engine.stats()["step_breakdown_s"]`): schedule, metadata,
  model, sampling, detokenize, tree, in ms per step;
- the model's forward split by op, by timing wrappers put around the model's pieces (every
  Linear = GEMM, the tied LM head's GEMM apart, RMSNorm, rotary (cos/sin + apply), the K/V write, attention kernel, the
  rest of the MLP = activation and product); "other" = forward time minus all of those:
  embedding, residual adds, reshapes, Python and torch dispatch between ops. The wrappers
  cost about a microsecond a call, counted in the op they wrap.

Times are wall-clock and CPU time (`process_time`, all threads) per step. On a shared machine
the wall times stretch with the other load; compare CPU times, and runs made side by side.

    PYTHONPATH=. nice -n 10 python bench/profile_step.py [--batch 1 4 16] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from radixserve import Engine, SamplingParams
from radixserve.benchmark.peer_workloads import corpus_text, window
from radixserve.models import llama as llama_module
from radixserve.models.layers import GatedMLP, Linear, RMSNorm
from radixserve.models.rope import RotaryEmbedding

OPS = ("gemm", "lm_head", "attention", "kv_write", "norm", "rope", "mlp_act", "other")


class OpClock:
    """Cumulative seconds per op while `enabled`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self.depth = 0

    def wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` timed into `op` (nested wrapped calls count in the outermost only)."""
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled or self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[op] += time.perf_counter() - start
                self.depth -= 1
        return timed


@contextmanager
def instrumented(engine: Engine, clock: OpClock) -> Iterator[None]:
    """Timing wrappers around the model's pieces; removed on exit."""
    saved: list[tuple[object, str, Any]] = []

    def patch(owner: object, name: str, op: str) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, clock.wrap(op, original))

    patch(Linear, "forward", "gemm")
    patch(RMSNorm, "forward", "norm")
    patch(RotaryEmbedding, "forward", "rope")
    for name in ("apply_rotary", "rotary_qk", "rms_norm"):
        if hasattr(llama_module, name):
            patch(llama_module, name, "rope" if "rot" in name else "norm")
    patch(llama_module, "write_kv", "kv_write")
    # The LM head is the one `linear` call that llama.py makes itself (the layers' go through
    # Linear.forward, which calls layers.linear): timed apart.
    patch(llama_module, "linear", "lm_head")
    patch(engine.runner.backend, "forward", "attention")
    mlp_forward = GatedMLP.forward

    def mlp(self: GatedMLP, x: torch.Tensor) -> torch.Tensor:  # the MLP less its GEMMs
        if not clock.enabled:
            return mlp_forward(self, x)
        before = clock.seconds["gemm"]
        start = time.perf_counter()
        out = mlp_forward(self, x)
        clock.seconds["mlp_act"] += time.perf_counter() - start - (clock.seconds["gemm"] - before)
        return out

    saved.append((GatedMLP, "forward", mlp_forward))
    GatedMLP.forward = mlp  # type: ignore[method-assign]
    forward = engine.runner.forward

    def timed_forward(*args: Any) -> Any:
        start = time.perf_counter()
        out = forward(*args)
        clock.seconds["forward"] += time.perf_counter() - start
        return out

    saved.append((engine.runner, "forward", forward))
    engine.runner.forward = timed_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            if owner is engine.runner or owner is engine.runner.backend:
                delattr(owner, name) if name in vars(owner) else None
            else:
                setattr(owner, name, original)


def prompts(engine: Engine, batch: int, tokens: int, salt: int) -> list[list[int]]:
    """`batch` distinct chat prompts of about `tokens` tokens of corpus text."""
    text = corpus_text()
    out = []
    for i in range(batch):
        body = window(text, (salt * 97 + i) * 173, tokens * 5)
        ids = engine.tokenizer.encode(f"Passage {salt}.{i}: {body}", add_special_tokens=False)[:tokens]
        out.append(ids)
    return out


def profile_batch(engine: Engine, batch: int, prompt_tokens: int, decode_steps: int,
                  salt: int) -> dict[str, Any]:
    """Prefill then `decode_steps` decode steps of `batch` requests; ms per step per section."""
    clock = OpClock()
    params = SamplingParams(max_tokens=decode_steps + 2, temperature=0.0, ignore_eos=True)
    for ids in prompts(engine, batch, prompt_tokens, salt):
        engine.add_request(ids, params)
    phases: dict[str, dict[str, float]] = {}
    with instrumented(engine, clock):
        for phase in ("prefill", "decode"):
            before = dict(engine.stats()["step_breakdown_s"])
            clock.seconds.clear()
            clock.enabled = True
            steps, wall, cpu = 0, 0.0, 0.0
            while engine.has_work():
                running = engine.scheduler.running
                decoding = running and not engine.scheduler.waiting and all(
                    s.num_computed >= len(s.token_ids) - 1 for s in running)
                if phase == "prefill" and decoding:
                    break
                start, cpu_start = time.perf_counter(), time.process_time()
                engine.step()
                wall += time.perf_counter() - start
                cpu += time.process_time() - cpu_start
                steps += 1
                if phase == "decode" and steps >= decode_steps:
                    break
            clock.enabled = False
            after = engine.stats()["step_breakdown_s"]
            sections = {k: (after[k] - before.get(k, 0.0)) * 1000 / max(steps, 1)
                        for k in after if k != "steps"}
            forward = clock.seconds.pop("forward", 0.0)
            ops = {op: clock.seconds.get(op, 0.0) * 1000 / max(steps, 1) for op in OPS if op != "other"}
            ops["other"] = forward * 1000 / max(steps, 1) - sum(ops.values())
            phases[phase] = {"steps": steps, "step_ms": wall * 1000 / max(steps, 1),
                             "step_cpu_ms": cpu * 1000 / max(steps, 1),
                             **{f"section_{k}_ms": v for k, v in sections.items()},
                             **{f"op_{k}_ms": v for k, v in ops.items()}}
    while engine.has_work():
        engine.step()
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3, help="medians of this many rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine(model=args.model, dtype=args.dtype, page_size=16, num_pages=2048)
    profile_batch(engine, 1, 32, 4, salt=999)  # warm up
    results: dict[str, Any] = {}
    for batch in args.batch:
        rounds = [profile_batch(engine, batch, args.prompt_tokens, args.decode_steps, salt=r * 100 + batch)
                  for r in range(args.repeat)]
        results[str(batch)] = {phase: {k: sorted(r[phase][k] for r in rounds)[len(rounds) // 2]
                                       for k in rounds[0][phase]} for phase in ("prefill", "decode")}
        for phase in ("prefill", "decode"):
            row = results[str(batch)][phase]
            ops = " ".join(f"{k[3:-3]} {v:.1f}" for k, v in row.items() if k.startswith("op_"))
            sections = " ".join(f"{k[8:-3]} {v:.1f}" for k, v in row.items() if k.startswith("section_"))
            print(f"batch {batch:>2} {phase:<7} step {row['step_ms']:.1f} ms (cpu {row['step_cpu_ms']:.1f}) | ops: {ops} | {sections}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
