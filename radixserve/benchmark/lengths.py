"""Length variation for benchmark workloads: prompts and outputs of unequal lengths.

Synthetic workloads give every request the same question and output length; real traffic
(ShareGPT, chat logs) spreads both widely, and that spread is what static batching wastes
(padding to a batch's longest prompt, waiting for its longest generation). These transforms
redraw the lengths of an existing workload while keeping its totals: the new lengths add up
to exactly the old ones, so a varied run moves the same number of tokens as the uniform one.

Distributions (`LENGTH_DISTRIBUTIONS`), for lengths of mean m, each at least 1:
- "uniform": 1 + (m - 1) * x with x evenly spaced over (0, 2), in random order (a stratified
  uniform draw): lengths spread evenly over 1 .. 2m - 1;
- "lognormal": 1 + (m - 1) * x / mean(x) with x ~ lognormal(sigma=1): a long right tail (the
  median is about 0.6 m, one request in 18 is over 3 m), the shape of ShareGPT's prompt and
  reply lengths.
Rounding keeps the sum exact (largest remainders).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from radixserve.benchmark.workloads import FIRST_ORDINARY_TOKEN, Workload

LENGTH_DISTRIBUTIONS = ("uniform", "lognormal")
LOGNORMAL_SIGMA = 1.0
_OUTPUT_STREAM, _PROMPT_STREAM = 1, 2  # independent random streams per seed


def spread_lengths(lengths: np.ndarray, distribution: str, rng: np.random.Generator) -> np.ndarray:
    """New lengths, each >= 1, with the same sum as `lengths` (all >= 1), drawn around their
    mean from `distribution` (see the module docstring)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return lengths
    if lengths.min() < 1:
        raise ValueError(f"lengths: every length must be >= 1, got {int(lengths.min())}")
    if distribution == "uniform":
        weights = rng.permutation((np.arange(lengths.size) + 0.5) * 2.0 / lengths.size)
    elif distribution == "lognormal":
        weights = rng.lognormal(-LOGNORMAL_SIGMA ** 2 / 2, LOGNORMAL_SIGMA, size=lengths.size)
    else:
        raise ValueError(f"distribution: expected one of {LENGTH_DISTRIBUTIONS}, got {distribution!r}")
    extra = int(lengths.sum()) - lengths.size  # tokens above the minimum of 1 each
    share = extra * weights / weights.sum()
    whole = np.floor(share).astype(np.int64)
    # Largest remainders take the tokens rounding down left over; ties by position (stable).
    leftover = extra - int(whole.sum())
    whole[np.argsort(-(share - whole), kind="stable")[:leftover]] += 1
    return 1 + whole


def with_varied_output_lengths(workload: Workload, seed: int = 0, distribution: str = "uniform") -> Workload:
    """The workload with output lengths redrawn from `distribution` (same total): a static
    batch then waits for its longest generation, as real requests make it."""
    rng = np.random.default_rng([seed, _OUTPUT_STREAM])
    lengths = spread_lengths(np.array([max(r.output_len, 1) for r in workload.requests]), distribution, rng)
    requests = [replace(r, output_len=int(n)) for r, n in zip(workload.requests, lengths)]
    return Workload(f"{workload.name}-varied-output", requests,
                    {**workload.params, "varied_output": distribution})


def with_varied_prompt_lengths(workload: Workload, vocab_size: int, seed: int = 0,
                               distribution: str = "uniform") -> Workload:
    """The workload with the unique part of every prompt (what follows its `shared_len`
    shared tokens: gsp's question, fewshot's question) redrawn from `distribution`, same
    total. Shared prefixes are untouched, so reuse is as before; a question keeps its first
    tokens (siblings stay distinct from their first token on) and is cut, or extended with
    random ordinary tokens below `vocab_size`. Workloads whose prompts extend earlier turns
    (a `parent`) are refused: their prompts are each other's prefixes."""
    if any(r.parent is not None for r in workload.requests):
        raise ValueError(f"{workload.name}: prompts extend earlier turns; vary-prompt needs independent prompts")
    unique = np.array([r.prompt_len - r.shared_len for r in workload.requests])
    if unique.size and unique.min() < 1:
        raise ValueError(f"{workload.name}: every prompt needs at least one token after its shared prefix")
    rng = np.random.default_rng([seed, _PROMPT_STREAM])
    lengths = spread_lengths(unique, distribution, rng)
    requests = []
    for request, length in zip(workload.requests, lengths.tolist()):
        prompt = request.prompt_ids[:request.shared_len + length]
        missing = request.shared_len + length - request.prompt_len
        if missing > 0:
            tail = rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=missing, dtype=np.int32)
            prompt = np.concatenate([request.prompt_ids, tail])
        requests.append(replace(request, prompt_ids=prompt.astype(np.int32, copy=False)))
    return Workload(f"{workload.name}-varied-prompt", requests,
                    {**workload.params, "varied_prompt": distribution})
