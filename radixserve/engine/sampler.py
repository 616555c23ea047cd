"""Logits → next tokens: greedy, temperature, top-k, top-p, min-p, seeded, with logprobs."""

from __future__ import annotations

import hashlib

import torch

from radixserve.engine.params import SamplingParams, TokenLogprob


def make_generator(params: SamplingParams, index: int, device: torch.device,
                   engine_rng: torch.Generator) -> torch.Generator | None:
    """A per-sample generator: seeded requests reproduce, unseeded ones draw from the engine."""
    if params.greedy:
        return None
    if params.seed is not None:
        # Any int seeds; torch takes 63 bits, so hash (seed, sample) down to them.
        digest = hashlib.blake2b(f"{params.seed}:{index}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") >> 1
    else:
        seed = int(torch.randint(0, 2**62, (1,), generator=engine_rng))
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Applies temperature, top-k, top-p and min-p to one row of logits; returns probabilities."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p: drop a token once the mass before it does.
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Samples one token per row of `logits` [B, vocab] (float32)."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if not p.greedy:
            probs = filter_logits(logits[row], p)
            tokens[row] = int(torch.multinomial(probs, 1, generator=generator))
    return tokens


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
    for row, i in enumerate(wanted):
        k = top_ks[i] or 0
        top = list(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist()))
        out[i] = TokenLogprob(tokens[i], float(logprobs[row, tokens[i]]), top)
    return out
