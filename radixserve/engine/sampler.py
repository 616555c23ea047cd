"""Logits → next tokens: greedy, temperature, top-k, top-p, min-p, seeded, with logprobs.

Vectorised over the batch: one pass of tensor ops for all rows, whatever mix of parameters
they carry; no Python loop over rows.

Randomness. Each sample has a 63-bit seed (derived from the request's `seed` and the
sample's index, or drawn from the engine's generator when the request has none), and its
t-th token is drawn by inverse transform sampling with one uniform number
u = hash(seed, t) (splitmix64, computed on the host with numpy). A token therefore depends
only on its own sample's seed, its position and its logits, never on its batch-mates or on
how the batch was composed, so "same seed, same tokens" holds with continuous batching and
after preemption (`t` counts generated tokens, which preemption keeps). A torch.Generator
per sample would give the same guarantee only with a Python loop over the rows.

On the CPU (float32 logits) one call of the fused C sampler (`radixserve.native.sampling`) does all of
this for every row when it is built, with the same semantics; the torch code below is the
path everywhere else.

Constrained rows (a request with a grammar: radixserve/grammar) come with a TokenMask: the
logits of the tokens their grammar forbids are set to -inf in place before they are sampled
(by the C sampler itself, in the pass that finds each masked row's maximum, when it runs, as
by its greedy function for a step whose rows are all greedy; by TokenMask.apply otherwise),
so greedy,
temperature, top-k, top-p and min-p all choose among the allowed tokens only, and rows
without a mask are not touched (nor is any work done for them).

Top-p without a full sort: the kept set is read off the `TOP_P_CANDIDATES` most likely
tokens (`topk`), and only rows whose kept set is larger fall back to sorting their whole
vocabulary. The top token is always kept (a `top_p` that rounds to zero, or a distribution
whose other tokens underflow, still samples it). Tokens tied with the last kept one are all
kept.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from radixserve.engine.params import SamplingParams, TokenLogprob
from radixserve.grammar import TokenMask
from radixserve.native import sampling as native_sampling

TOP_P_CANDIDATES = 256
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def sampling_seed(params: SamplingParams, index: int, engine_rng: torch.Generator) -> int | None:
    """A sample's 63-bit seed: seeded requests reproduce, unseeded ones draw from the engine;
    None for greedy sampling."""
    if params.greedy:
        return None
    if params.seed is not None:
        # Any int seeds; hash (seed, sample) down to 63 bits.
        digest = hashlib.blake2b(f"{params.seed}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1
    return int(torch.randint(0, 2**62, (1,), generator=engine_rng))


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: list[int], steps: list[int]) -> np.ndarray:
    """One uniform number in [0, 1) per (seed, step): float64, 53 random bits each."""
    with np.errstate(over="ignore"):
        state = _mix64(np.asarray(seeds, dtype=np.uint64) ^ _GOLDEN)
        z = _mix64(state + (np.asarray(steps, dtype=np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(11)).astype(np.float64) * 2.0**-53


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, min-p and top-p over rows of logits [R, V] (float32), each row with
    its own parameters (tensors [R]; top_k 0, top_p 1 and min_p 0 are off). Returns the
    softmax probabilities with filtered tokens zeroed, not renormalised."""
    vocab = logits.shape[-1]
    x = (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    if bool((k < vocab).any()):
        kth = torch.topk(x, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if bool((top_p < 1).any()):
        probs = _top_p(probs, top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches top_p (a token is
    dropped once the mass before it does), at least the top token."""
    if probs.device.type == "cpu":
        threshold = torch.from_numpy(_top_p_thresholds_host(probs.numpy(), top_p.numpy()))
    else:
        threshold = _top_p_thresholds(probs, top_p)
    threshold = torch.where(top_p[:, None] < 1, threshold, 0.0)
    return probs.masked_fill(probs < threshold, 0.0)


def _top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The probability of the last kept token, per row ([R, 1]); on the device."""
    vocab = probs.shape[-1]
    width = min(vocab, TOP_P_CANDIDATES)
    candidates = torch.topk(probs, width, dim=-1).values  # sorted, descending
    kept = _kept_count(candidates, top_p)
    threshold = candidates.gather(1, (kept - 1)[:, None])
    if width < vocab:
        incomplete = (kept == width) & (top_p < 1)
        if bool(incomplete.any()):
            rows = incomplete.nonzero().squeeze(1)
            full = torch.sort(probs[rows], dim=-1, descending=True).values
            threshold = threshold.index_copy(0, rows, full.gather(1, (_kept_count(full, top_p[rows]) - 1)[:, None]))
    return threshold


def _kept_count(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    return (mass_before < top_p[:, None]).sum(dim=-1).clamp(min=1)


def _top_p_thresholds_host(probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """`_top_p_thresholds` with numpy, for CPU tensors: `np.partition` then a sort of the
    candidates only (torch's CPU topk and sort are several times slower than numpy's)."""
    vocab = probs.shape[-1]
    width = min(vocab, TOP_P_CANDIDATES)
    candidates = -np.sort(-np.partition(probs, vocab - width, axis=-1)[:, vocab - width:], axis=-1)
    kept = _kept_count_host(candidates, top_p)
    threshold = np.take_along_axis(candidates, kept[:, None] - 1, axis=-1)
    if width < vocab:
        rows = np.flatnonzero((kept == width) & (top_p < 1))
        if len(rows):
            full = -np.sort(-probs[rows], axis=-1)
            threshold[rows] = np.take_along_axis(full, _kept_count_host(full, top_p[rows])[:, None] - 1, axis=-1)
    return threshold


def _kept_count_host(sorted_probs: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    mass_before = np.cumsum(sorted_probs, axis=-1) - sorted_probs
    return np.maximum((mass_before < top_p[:, None]).sum(axis=-1), 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one row of logits under `params` (normalised; greedy
    parameters give all the mass to the argmax)."""
    if params.greedy:
        return torch.zeros_like(logits, dtype=torch.float32).index_fill_(0, logits.argmax(), 1.0)
    row = logits[None].float()
    probs = filter_probs(row, *_param_tensors([params], row.device))[0]
    return probs / probs.sum()


def _param_tensors(params: list[SamplingParams], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature, top_k, top_p, min_p as tensors [R] (float32 / int64)."""
    values = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p in params], dtype=np.float64)
    as_float = torch.from_numpy(values.astype(np.float32)).to(device)
    top_k = torch.from_numpy(values[:, 1].astype(np.int64)).to(device)
    return as_float[:, 0], top_k, as_float[:, 2], as_float[:, 3]


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None],
           steps: list[int], mask: TokenMask | None = None) -> list[int]:
    """One token per row of `logits` [B, vocab] (float32). Row b uses `params[b]`; a sampled
    (non-greedy) row draws with `seeds[b]` at position `steps[b]` (the tokens its sample
    generated before this one). `mask` restricts its rows to their allowed tokens: it writes
    -inf into `logits` (so logprobs computed afterwards are the constrained distribution's)."""
    random_rows = [b for b, p in enumerate(params) if not p.greedy]
    if not random_rows:
        # Every row greedy: (mask and) argmax in one C pass per row on the CPU; right after the
        # forward pass the caches are cold, and the torch ops' dispatch cost several times the C.
        tokens = native_sampling.greedy_tokens(logits, None if mask is None else mask.native_mask())
        if tokens is not None:
            return _checked_tokens(tokens)
        if mask is not None:
            mask.apply(logits)
        return _host_tokens(_flag_unsampleable(logits, torch.argmax(logits, dim=-1), None))
    native = native_sampling.usable(logits)
    if mask is not None and not native:  # the C sampler masks each row as it samples it
        mask.apply(logits)
    if native:
        tokens = _sample_native(logits, params, seeds, steps, random_rows, mask)
        greedy = torch.tensor([b for b, p in enumerate(params) if p.greedy], dtype=torch.int64)
        return _host_tokens(_flag_unsampleable(logits, torch.tensor(tokens), greedy))
    device = logits.device
    everyone = len(random_rows) == len(params)
    rows = torch.tensor(random_rows, dtype=torch.int64, device=device)
    probs = filter_probs((logits if everyone else logits.index_select(0, rows)).float(),
                         *_param_tensors([params[b] for b in random_rows], device))
    u = seeded_uniforms([seeds[b] for b in random_rows], [steps[b] for b in random_rows])
    drawn = _inverse_transform(probs, torch.from_numpy(u).to(device))
    if everyone:
        return drawn.tolist()
    greedy_rows = torch.tensor([b for b, p in enumerate(params) if p.greedy], dtype=torch.int64, device=device)
    tokens = torch.empty(len(params), dtype=torch.int64, device=device)
    tokens.index_copy_(0, rows, drawn)
    tokens.index_copy_(0, greedy_rows, torch.argmax(logits.index_select(0, greedy_rows), dim=-1))
    return _host_tokens(_flag_unsampleable(logits, tokens, greedy_rows))


def _flag_unsampleable(logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`tokens` with -1 at the greedy `rows` (None: every row) whose logits hold a NaN or only
    -inf: argmax returns the first NaN (or 0) there, which would pass for a token. Reads one
    logit per row (the chosen one is NaN exactly when the row has one), on the logits' device
    and without waiting for it: the caller's one copy of the tokens to the host carries the
    verdict (as the C sampler's -1 does), so a GPU step does not sync twice."""
    device = logits.device
    tokens = tokens.to(device)
    if rows is None:
        chosen = logits.gather(1, tokens[:, None]).squeeze(1)
        return tokens.masked_fill(~(torch.isfinite(chosen) | (chosen == float("inf"))), -1)
    if not len(rows):
        return tokens
    rows = rows.to(device)
    chosen = logits[rows, tokens[rows]]
    bad = ~(torch.isfinite(chosen) | (chosen == float("inf")))
    return tokens.index_put((rows,), torch.where(bad, -1, tokens[rows]))


def _host_tokens(tokens: torch.Tensor) -> list[int]:
    """The tokens as a list (the step's one device-to-host copy); ValueError naming the rows
    flagged -1 (their logits are not finite)."""
    return _checked_tokens(tokens.tolist())


def _checked_tokens(out: list[int]) -> list[int]:
    """`out`, or ValueError naming its rows flagged -1 (their logits are not finite)."""
    bad = [row for row, token in enumerate(out) if token < 0]
    if bad:
        raise ValueError(f"cannot sample rows {bad}: their logits are not finite")
    return out


def _sample_native(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None],
                   steps: list[int], random_rows: list[int], mask: TokenMask | None) -> list[int]:
    """`sample` in one call of the C sampler (greedy rows have temperature 0 there), which
    applies the mask's rows as it goes."""
    values = np.array([(0.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p) for p in params],
                      dtype=np.float64)
    u = np.zeros(len(params))
    u[random_rows] = seeded_uniforms([seeds[b] for b in random_rows], [steps[b] for b in random_rows])  # type: ignore[misc]
    tokens, _ = native_sampling.run(logits, values[:, 0], values[:, 1].astype(np.int64), values[:, 2],
                                    values[:, 3], u, mask=None if mask is None else mask.native_mask())
    bad = np.flatnonzero(tokens < 0)
    if bad.size:
        raise ValueError(f"cannot sample rows {bad.tolist()}: their logits are not finite")
    return tokens.tolist()


def _inverse_transform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative-probability interval holds u * total mass, per row."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    invalid = ~torch.isfinite(total) | (total <= 0)  # NaN or +inf logits spread to the total
    if bool(invalid.any()):
        rows = invalid.squeeze(1).nonzero().squeeze(1).tolist()
        raise ValueError(f"cannot sample rows {rows}: their logits are not finite")
    # x < total: some token's interval ends above x, and that token has mass > 0.
    x = torch.minimum((u[:, None] * total.double()).float(), torch.nextafter(total, torch.zeros_like(total)))
    drawn = torch.searchsorted(cdf, x, right=True).clamp(max=probs.shape[-1] - 1)
    # A device scan may be off by a rounding step; never return a token of zero mass.
    zero = probs.gather(1, drawn).squeeze(1) == 0
    if bool(zero.any()):
        positions = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
        last_positive = torch.where(probs > 0, positions, -1).cummax(dim=-1).values
        drawn = torch.where(zero[:, None], last_positive.gather(1, drawn), drawn)
    return drawn.squeeze(1)


def compute_logprobs(logits: torch.Tensor, tokens: list[int], top_ks: list[int | None]
                     ) -> list[TokenLogprob | None]:
    """Log-probabilities of the chosen tokens under the model's distribution, plus top-k."""
    wanted = [i for i, k in enumerate(top_ks) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(tokens)
    if not wanted:
        return out
    logprobs = torch.log_softmax(logits[wanted], dim=-1)
    max_k = max(top_ks[i] for i in wanted)  # type: ignore[type-var]
    top_values, top_ids = torch.topk(logprobs, max(max_k, 1), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=logits.device))
    top_ids_rows, top_values_rows, chosen_rows = top_ids.tolist(), top_values.tolist(), chosen[:, 0].tolist()
    for row, i in enumerate(wanted):
        k = top_ks[i] or 0
        # A constrained row's forbidden tokens (-inf) are no alternatives.
        top = [(t, v) for t, v in zip(top_ids_rows[row][:k], top_values_rows[row][:k]) if v != float("-inf")]
        out[i] = TokenLogprob(tokens[i], chosen_rows[row], top)
    return out
